"""Seeded random attention configurations for the fuzz tests, and one function that runs and checks a case.

A case is a JSON-serializable dict drawn by :func:`draw_case` from ``(seed, index)`` alone, so any case is
reproduced by its seed and index (``python tests/support/fuzz_worker.py --seed S --start I --count 1 --out -``).
Cases come in families of :data:`FAMILY` consecutive indices that share everything a cuDNN graph is built
for (dtype, shapes, strides, mask, scale, sinks, need_lse, max_seqlen bounds) and redraw only the data and
the lengths (dense ``seqlens``, packed document lengths under the family's bounds), so each family builds
one forward and one backward graph rather than one per case.

Profiles: ``"gpu"`` (float16/bfloat16, D 32..256, S up to 300, T up to 1000, and a quarter of the families
step-sized: S up to 2048, T up to 3000, documents up to 2047 tokens, up to 64 heads) and ``"cpu"`` (float32,
small shapes, served by the exact fallback).

Adversarial families (a quarter on the GPU, drawn from a stream of their own so the other families are what they were):
query rows anti-aligned with every key (all of them, a quarter, or one; every score of such a row near -100 or -130 plus
``log S_kv``, so its log-sum-exp is below -88.7 or -120; see ``support.adversarial``), or scales far from the usual
(1e-4 to 50); dense key lengths from every class of S mod 128 (64 among them: 64, 192, 576, 1088) and single-query rows
against long keys. The check is the same: no NaN or Inf where the float64 reference has none, and every tensor within
the rule.
"""

from __future__ import annotations

import itertools
import math
import random
import time
import traceback

import torch

from support.adversarial import anti_align

__all__ = ["FAMILY", "case_label", "draw_case", "run_case"]

FAMILY = 4

PROFILES = {
    "gpu": dict(
        dtypes=["float16", "bfloat16"],
        head_dims=[32, 40, 64, 80, 96, 128, 160, 192, 256],
        seq=[1, 2, 16, 33, 64, 100, 128, 200, 256, 300],
        batch=[1, 2, 3, 4],
        kv_heads=[1, 2, 4],
        docs=[1, 2, 3, 5, 8],
        doc_bound=[1, 16, 64, 100, 128, 200, 256],
        tokens=[16, 64, 150, 300, 512, 700, 1000],
        windows=[0, 1, 3, 7, 32, 100, 128],
        max_heads=16,
        # A quarter of the families are step-sized: long documents, many heads, the sizes of a fine-tuning step.
        # Errors that touch a few rows in a hundred thousand (the sink fold's, see test_fused_sinks.py) need them.
        large=0.25,
        large_seq=[512, 1000, 1500, 2048],
        large_batch=[1, 2, 4],
        large_docs=[2, 3, 5, 8, 9],
        large_doc_bound=[300, 500, 598, 1023, 1500, 2047],
        large_tokens=[1024, 1500, 2048, 2500, 3000],
        large_windows=[1, 3, 127, 128, 511],
        large_max_heads=64,
        # The float64 reference holds a few (H, Q, K) score tensors per worker: heads are halved until
        # heads x rows x keys fits this many elements (about 0.6 GB each in float64).
        large_scores=80_000_000,
        adversarial=0.25,
        adversarial_seq_kv=[64, 192, 320, 576, 1088, 128, 256, 512, 1024, 200, 1000],
        adversarial_seq_q=[1, 1, 7, 64, 192],
    ),
    "cpu": dict(
        dtypes=["float32"],
        head_dims=[8, 16, 24],
        seq=[1, 2, 5, 9, 16, 23],
        batch=[1, 2, 3],
        kv_heads=[1, 2],
        docs=[1, 2, 3, 5],
        doc_bound=[1, 4, 9, 16],
        tokens=[8, 20, 40, 64],
        windows=[0, 1, 3, 7],
        max_heads=8,
        large=0.0,
        adversarial=0.25,
        adversarial_seq_kv=[16, 23, 64, 192],
        adversarial_seq_q=[1, 1, 5, 16],
    ),
}

DENSE_LAYOUTS = ["bhsd", "bshd", "qkv_interleaved", "mixed"]
PACKED_LAYOUTS = ["thd", "head_major", "qkv_interleaved", "mixed"]


def _rng(*key) -> random.Random:
    return random.Random(":".join(str(part) for part in key))  # str seeds hash deterministically (sha512)


def _draw_family(seed: int, family: int, profile: str) -> dict:
    p = PROFILES[profile]
    r = _rng("family", seed, family, profile)
    kind = r.choices(["dense", "padded", "packed"], weights=[3, 3, 4])[0]
    large = r.random() < p["large"]
    if large:
        p = {
            **p,
            "seq": p["large_seq"],
            "batch": p["large_batch"],
            "docs": p["large_docs"],
            "doc_bound": p["large_doc_bound"],
            "tokens": p["large_tokens"],
            "windows": p["large_windows"],
            "max_heads": p["large_max_heads"],
            "kv_heads": [1, 2, 4, 8],
        }
    layouts = DENSE_LAYOUTS if kind != "packed" else PACKED_LAYOUTS
    layout = r.choices(layouts, weights=[3, 3, 2, 2])[0]
    ratio = r.choice([1, 2, 4, 8, "mqa"])
    if ratio == "mqa":
        h_kv, h_q = 1, r.choice([h for h in (2, 4, 8, 16) if h <= p["max_heads"]])
    else:
        h_kv = r.choice(p["kv_heads"])
        while h_kv * ratio > p["max_heads"]:
            h_kv = max(1, h_kv // 2)
        h_q = h_kv * ratio
    d = r.choice(p["head_dims"])
    d_v = d if r.random() < 0.8 else r.choice(p["head_dims"])
    fam = dict(profile=profile, kind=kind, layout=layout, dtype=r.choice(p["dtypes"]), h_q=h_q, h_kv=h_kv, d=d, d_v=d_v, large=large)
    if layout == "qkv_interleaved":
        fam["d_v"] = d  # one fused projection: one head dim
    # Mask: none / causal / window (FlashAttention's (left, right)), bottom-right or not.
    mask = r.choices(["none", "causal", "window"], weights=[3, 3, 4])[0]
    left, right, causal = -1, -1, False
    if mask == "causal":
        causal = True
        left = r.choice([-1, -1, *p["windows"]])
    elif mask == "window":
        left, right = r.choice([-1, *p["windows"]]), r.choice([-1, *p["windows"]])
        if left == -1 and right == -1:
            right = r.choice(p["windows"])
        if right in (-1, 0) and r.random() < 0.3:
            causal, right = True, r.choice([-1, 0])  # causal with a left window, right spelled -1 or 0
    fam.update(mask=mask, causal=causal, window_size=[left, right], bottom_right=r.random() < 0.5)
    scale_kind = r.choices(["default", "value", "zero", "negative"], weights=[50, 35, 5, 10])[0]
    fam["scale"] = {"default": None, "value": r.choice([0.05, 0.125, 0.3, 1.0]), "zero": 0.0, "negative": r.choice([-0.125, -0.5])}[
        scale_kind
    ]
    fam["sinks"] = r.choice(["float32", "input"]) if r.random() < 0.4 else None
    fam["grads"] = r.random() < 0.85
    fam["return_lse"] = r.random() < 0.3
    if kind in ("dense", "padded"):
        fam["b"] = r.choice(p["batch"])
        fam["s_q"] = r.choice(p["seq"])
        fam["s_kv"] = fam["s_q"] if (r.random() < 0.6 or layout == "qkv_interleaved") else r.choice(p["seq"])
        if kind == "padded":
            fam["which_lengths"] = r.choice(["both", "both", "both", "q", "kv"])
            fam["lengths_dtype"] = r.choice(["int32", "int64"])
    else:
        fam["docs"] = r.choice(p["docs"])
        fam["same_cu"] = r.random() < 0.5
        all_empty = r.random() < 0.02
        fam["bound_q"] = 0 if all_empty else r.choice(p["doc_bound"])
        fam["bound_kv"] = fam["bound_q"] if fam["same_cu"] or all_empty else r.choice(p["doc_bound"])
        fam["t_q"] = r.choice(p["tokens"])
        fam["t_kv"] = fam["t_q"] if (fam["same_cu"] or layout == "qkv_interleaved") else r.choice(p["tokens"])
        fam["cu_dtype"] = r.choice(["int32", "int64"])
        # A bound beyond the token count is refused (no document can be that long); clamped after the draws, so each
        # seed draws the same families as before.
        fam["bound_q"], fam["bound_kv"] = min(fam["bound_q"], fam["t_q"]), min(fam["bound_kv"], fam["t_kv"])
    _draw_adversarial(fam, seed, family, p)
    if large:
        rows, keys = (fam["b"] * fam["s_q"], fam["s_kv"]) if kind != "packed" else (fam["t_q"], fam["t_kv"])
        while fam["h_q"] > 1 and fam["h_q"] * rows * keys > p["large_scores"]:
            fam["h_kv"] = max(1, fam["h_kv"] // 2)  # powers of two: halving both keeps the group size, MQA keeps 1
            fam["h_q"] //= 2
    return fam


def _draw_adversarial(fam: dict, seed: int, family: int, p: dict) -> None:
    """Make a fraction of the families adversarial (``fam["adversarial"]``), from a random stream of their own: anti-aligned
    query rows, or an extreme scale; dense ones get key lengths of every class of S mod 128 and single-query rows."""
    r = _rng("adversarial", seed, family, fam["profile"])
    if r.random() >= p["adversarial"]:
        fam["adversarial"] = None
        return
    kind = r.choices(["anti_aligned", "large_scale", "small_scale"], weights=[6, 1, 1])[0]
    if kind == "anti_aligned":
        fam["adversarial"] = {"kind": kind, "target": r.choice([100.0, 130.0]), "rows": r.choice(["all", "some", "one"])}
        if fam["scale"] == 0:
            fam["scale"] = None  # a zero scale makes every score 0: nothing to anti-align
    else:
        fam["adversarial"] = {"kind": kind}
        fam["scale"] = r.choice([8.0, 30.0, 50.0] if kind == "large_scale" else [1e-4, 1e-3, 1e-2])
    if fam["kind"] != "packed":
        fam["s_kv"] = r.choice(p["adversarial_seq_kv"])
        fam["s_q"] = fam["s_kv"] if fam["layout"] == "qkv_interleaved" or r.random() < 0.5 else r.choice(p["adversarial_seq_q"])


def _doc_lengths(r: random.Random, docs: int, bound: int, total: int) -> list[int]:
    """``docs`` lengths in ``[0, bound]`` summing to at most ``total``: empty and length-1 documents included."""
    # min(): with bound 0 (every document empty) a length of 1 would be invalid input, not a case.
    lengths = [min(bound, r.choices([0, 1, bound, r.randint(0, bound)], weights=[1, 1, 2, 6])[0]) for _ in range(docs)]
    order = list(range(docs))
    r.shuffle(order)
    for i in itertools.cycle(order):
        if sum(lengths) <= total:
            break
        lengths[i] //= 2
    return lengths


def _row_lengths(r: random.Random, b: int, s: int) -> list[int]:
    lengths = []
    for _ in range(b):
        u = r.random()
        if u < 0.15:
            lengths.append(0)
        elif u < 0.40:
            lengths.append(s)
        elif u < 0.97:
            lengths.append(r.randint(1, s))
        else:  # out of range: clamped to [0, S]
            lengths.append(r.choice([-3, -1, s + 1, s + 50]))
    return lengths


def draw_case(seed: int, index: int, profile: str = "gpu") -> dict:
    """The case at ``index`` of run ``seed``: its family's structure plus this variant's lengths and data seed."""
    case = _draw_family(seed, index // FAMILY, profile)
    r = _rng("variant", seed, index, profile)
    case.update(seed=seed, index=index, data_seed=r.randrange(2**31))
    if case["kind"] == "padded":
        b = case["b"]
        case["seqlens_q"] = _row_lengths(r, b, case["s_q"]) if case["which_lengths"] in ("both", "q") else None
        case["seqlens_kv"] = _row_lengths(r, b, case["s_kv"]) if case["which_lengths"] in ("both", "kv") else None
    elif case["kind"] == "packed":
        lengths_kv = _doc_lengths(r, case["docs"], case["bound_kv"], case["t_kv"])
        lengths_q = lengths_kv if case["same_cu"] else _doc_lengths(r, case["docs"], case["bound_q"], case["t_q"])
        case["lengths_q"], case["lengths_kv"] = lengths_q, lengths_kv
        # Equal prefix sums as one tensor (how callers pass them; its capacity tail is set after the kernels) or two.
        # Drawn last, so every earlier draw of a seed is what it was.
        case["one_cu_tensor"] = case["same_cu"] and r.random() < 0.5
    return case


def case_label(case: dict) -> str:
    return f"{case['kind']}/{case['layout']}"


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def _randn(shape, dtype, device):
    return torch.randn(shape, dtype=dtype, device=device)


def _interleaved(case, shape, dtype, device):
    # The leaf buffer requires grad before the views are taken, so q, k and v are differentiable views of it.
    return _randn(shape, dtype, device).requires_grad_(case["grads"])


def _dense_inputs(case, dtype, device):
    B, Hq, Hkv, Sq, Skv, D, Dv = case["b"], case["h_q"], case["h_kv"], case["s_q"], case["s_kv"], case["d"], case["d_v"]
    layout = case["layout"]
    if layout == "qkv_interleaved":
        if Hq == Hkv:  # (B, S, 3, H, D).unbind(2), each seen as (B, H, S, D)
            buf = _interleaved(case, (B, Sq, 3, Hq, D), dtype, device)
            return [t.transpose(1, 2) for t in buf.unbind(2)], buf
        buf = _interleaved(case, (B, Sq, Hq + 2 * Hkv, D), dtype, device)  # GQA's fused projection split along heads
        return [t.transpose(1, 2) for t in buf.split([Hq, Hkv, Hkv], dim=2)], buf
    shapes = [(B, Hq, Sq, D), (B, Hkv, Skv, D), (B, Hkv, Skv, Dv)]
    r = _rng("layout", case["seed"], case["index"])
    tensors = []
    for shape in shapes:
        which = layout if layout != "mixed" else r.choice(["bhsd", "bshd"])
        if which == "bhsd":
            tensors.append(_randn(shape, dtype, device))
        else:
            b, h, s, d = shape
            tensors.append(_randn((b, s, h, d), dtype, device).transpose(1, 2))
    return tensors, None


def _packed_inputs(case, dtype, device, T_q, T_kv):
    Hq, Hkv, D, Dv = case["h_q"], case["h_kv"], case["d"], case["d_v"]
    layout = case["layout"]
    if layout == "qkv_interleaved":
        if Hq == Hkv:  # (T, 3, H, D).unbind(1)
            buf = _interleaved(case, (T_q, 3, Hq, D), dtype, device)
            return list(buf.unbind(1)), buf
        buf = _interleaved(case, (T_q, Hq + 2 * Hkv, D), dtype, device)
        return list(buf.split([Hq, Hkv, Hkv], dim=1)), buf
    shapes = [(T_q, Hq, D), (T_kv, Hkv, D), (T_kv, Hkv, Dv)]
    r = _rng("layout", case["seed"], case["index"])
    tensors = []
    for shape in shapes:
        which = layout if layout != "mixed" else r.choice(["thd", "head_major"])
        if which == "thd":
            tensors.append(_randn(shape, dtype, device))
        else:  # a (T, H, D) view of (H, T, D) memory
            t, h, d = shape
            tensors.append(_randn((h, t, d), dtype, device).transpose(0, 1))
    return tensors, None


def build_call(case: dict, device: str):
    """``(api, args, kwargs)`` for the case, with the data drawn from ``case["data_seed"]``."""
    dtype = getattr(torch, case["dtype"])
    torch.manual_seed(case["data_seed"])
    kwargs = dict(
        scale=case["scale"],
        causal=case["causal"],
        bottom_right=case["bottom_right"],
        window_size=tuple(case["window_size"]),
        return_lse=case["return_lse"],
    )
    if case["kind"] != "packed":
        (q, k, v), buf = _dense_inputs(case, dtype, device)
    else:
        cu_dtype = getattr(torch, case["cu_dtype"])
        cu_q = torch.tensor([0, *itertools.accumulate(case["lengths_q"])], dtype=cu_dtype, device=device)
        cu_kv = (
            cu_q
            if case.get("one_cu_tensor")
            else torch.tensor([0, *itertools.accumulate(case["lengths_kv"])], dtype=cu_dtype, device=device)
        )
        (q, k, v), buf = _packed_inputs(case, dtype, device, case["t_q"], case["t_kv"])
    if (case.get("adversarial") or {}).get("kind") == "anti_aligned":
        scale = case["scale"] if case["scale"] is not None else case["d"] ** -0.5
        keys = case["s_kv"] if case["kind"] != "packed" else max(max(case["lengths_kv"], default=1), 1)
        generator = torch.Generator().manual_seed(case["data_seed"])
        anti_align(
            q,
            k,
            scale=scale,
            target=case["adversarial"]["target"] + math.log(keys),
            rows=case["adversarial"]["rows"],
            generator=generator,
            packed=case["kind"] == "packed",
        )
    if case["sinks"] is not None:
        sink_dtype = torch.float32 if case["sinks"] == "float32" else dtype
        kwargs["sinks"] = (2 * _randn((case["h_q"],), torch.float32, device)).to(sink_dtype).requires_grad_(case["grads"])
    if case["grads"] and buf is None:
        for t in (q, k, v):
            t.requires_grad_()
    if case["kind"] == "dense":
        return "dense", (q, k, v), kwargs
    if case["kind"] == "padded":
        ld = getattr(torch, case["lengths_dtype"])
        for name in ("seqlens_q", "seqlens_kv"):
            if case[name] is not None:
                kwargs[name] = torch.tensor(case[name], dtype=ld, device=device)
        return "dense", (q, k, v), kwargs
    return "varlen", (q, k, v, cu_q, cu_kv, case["bound_q"], case["bound_kv"]), kwargs


# ----------------------------------------------------------------------------------------------
# Running a case
# ----------------------------------------------------------------------------------------------


def _short_reason(reason: str) -> str:
    reason = reason.split(":")[0] if reason.startswith("cuDNN rejected") else reason
    return reason[:80]


def served_path(stats: dict) -> str:
    """``"cudnn"``, ``"fallback: <reason>"`` or ``"none"`` for the forward of one call (from ``cudnn_attention.stats()``)."""
    if stats["cudnn_forward"]:
        return "cudnn"
    if stats["fallback_forward"]:
        return "fallback: " + "; ".join(sorted(_short_reason(r) for r in stats["fallback_forward"]))
    return "none"


def run_case(case: dict, device: str, *, floor_rel: float | None = None) -> dict:
    """Build, run and check one case; never raises. Returns a JSON-serializable record."""
    import cudnn_attention
    from support.reference64 import evaluate_call

    record = {"index": case["index"], "label": case_label(case), "ok": False, "path": "none", "backward_path": "none"}
    start = time.perf_counter()
    try:
        api, args, kwargs = build_call(case, device)
        cudnn_attention.reset_stats()
        result = evaluate_call(
            "dense" if api == "dense" else "varlen", args, kwargs, grads=case["grads"], floor_rel=floor_rel, grad_seed=case["data_seed"] + 1
        )
        stats = cudnn_attention.stats()
        record["path"] = served_path(stats)
        record["backward_path"] = "cudnn" if stats["cudnn_backward"] else ("fallback" if stats["fallback_backward"] else "none")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        record.update(ok=result["ok"], errors=result["error_summary"], failures=[c for c in result["checks"] if not c["ok"]])
    except Exception as exc:  # noqa: BLE001 - a case's exception is its failure, reported with the config
        record.update(ok=False, exception=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:])
        try:
            record["path"] = served_path(cudnn_attention.stats())
        except Exception:  # noqa: BLE001
            pass
    record["seconds"] = round(time.perf_counter() - start, 4)
    return record


# ----------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------


def _table(title: str, rows: dict) -> list[str]:
    """``rows``: key -> (cases, failures)."""
    width = max([len(title), *(len(str(key)) for key in rows)])
    lines = [f"{title:<{width}}  {'cases':>6}  {'failed':>6}"]
    for key, (cases, failed) in sorted(rows.items(), key=lambda item: (-item[1][0], str(item[0]))):
        lines.append(f"{str(key):<{width}}  {cases:>6}  {failed:>6}")
    return lines


def summarize(records: dict, configs: dict, *, seed: int, requested: int, repro: str = "", max_failures: int = 400) -> str:
    """A plain-text report: totals, counts by layout / dtype / mask / path served, and the failing cases."""
    from collections import defaultdict

    groups = {name: defaultdict(lambda: [0, 0]) for name in ("layout", "dtype", "mask", "forward path", "backward path", "failed check")}
    failures = [index for index, rec in sorted(records.items()) if not rec.get("ok")]
    for index, rec in records.items():
        cfg = configs.get(index, {})
        bad = not rec.get("ok")
        keys = {
            "layout": case_label(cfg) if cfg else rec.get("label", "?"),
            "dtype": cfg.get("dtype", "?"),
            "mask": f"{cfg.get('mask', '?')}{'+bottom_right' if cfg.get('bottom_right') else ''}{'+sinks' if cfg.get('sinks') else ''}",
            "forward path": rec.get("path", "none"),
            "backward path": rec.get("backward_path", "none") if cfg.get("grads", True) else "(no grads)",
        }
        for group, key in keys.items():
            groups[group][key][0] += 1
            groups[group][key][1] += int(bad)
        if bad:
            names = [f["name"] for f in rec.get("failures", [])] or [rec.get("exception", "?").split(":")[0]]
            for name in names:
                groups["failed check"][name][0] += 1
                groups["failed check"][name][1] += 1
    lines = [f"cudnn_attention fuzz: seed {seed}, {len(records)} of {requested} cases run, {len(failures)} failed", ""]
    for name, rows in groups.items():
        if rows:
            lines += _table(name, {k: tuple(v) for k, v in rows.items()}) + [""]
    if failures:
        lines.append(f"failing cases (first {min(len(failures), max_failures)} of {len(failures)}):")
        for index in failures[:max_failures]:
            rec, cfg = records[index], configs.get(index, {})
            what = "; ".join(f"{f['name']}: {f['why']}" for f in rec.get("failures", [])) or rec.get("exception", "?")
            lines.append(f"  #{index} [{rec.get('path', '?')}] {what}")
            shown = {k: v for k, v in cfg.items() if k not in ("seed", "index", "profile")}
            lines.append(f"      config: {shown}")
            if repro:
                lines.append(f"      rerun:  {repro.format(seed=seed, index=index)}")
    return "\n".join(lines)
