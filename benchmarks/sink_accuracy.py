"""How far each learnable-sink attention lands from float64, at gpt-oss's attention shape, beside FlashAttention 4.

    python3 benchmarks/sink_accuracy.py --out benchmarks/results      # on a GPU; FA4 joins where flash_attn.cute imports

Inputs (bf16, one seed per row): packed, 2,048 tokens in documents of 768 / 256 / 1,024, H 64/8, D 64 (gpt-oss);
dense, B 2, S 1,024, the same heads; each with gpt-oss's sliding window (128, 0) and fully causal. Sinks are
``2 * randn`` float32 logits, the output gradient ``randn``. For each implementation: max |error| of the output, dQ,
dK, dV and dSink against the float64 reference (``tests/support/reference64.py``), and each as a multiple of a plain PyTorch bf16
implementation's error on the same inputs: transformers' gpt-oss eager attention (bf16 scores, the sink logit
concatenated, a bf16 softmax, a bf16 P @ V), per document when packed. FlashAttention's tests allow 2x.

Implementations: ``cudnn fold`` (the sink-less cuDNN kernel, then the fused fold: the default for packed calls),
``cudnn engine`` (cuDNN's sink engine: the default for dense calls), ``flash_attention_4`` (``flash_attn.cute``,
learnable-sink backward), and the bf16 eager yardstick. ``--time`` adds forward+backward milliseconds (median of 30,
host time included: at 2,048 tokens these calls are launch-bound, so it is no kernel comparison;
``attention_kernels.py`` is).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' float64 reference: `support.reference64`

H_Q, H_KV, D = 64, 8, 64
DOCS = [768, 256, 1024]
DENSE_B, DENSE_S = 2, 1024
MASKS = {"window 128": (128, 0), "causal": (-1, 0)}
TENSORS = {"out": "out", "dq": "dQ", "dk": "dK", "dv": "dV", "dsinks": "dSink"}  # result key: column label


def _fa4():
    try:
        import flash_attn.cute as fa4  # noqa: PLC0415 - optional, installed on some GPU machines only

        return fa4
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return None


def inputs(layout: str, seed: int):
    """q, k, v and sinks as leaves that require grad, and the output gradient."""
    torch.manual_seed(seed)
    if layout == "packed":
        tokens = sum(DOCS)
        q, k, v = (torch.randn(tokens, h, D, device="cuda", dtype=torch.bfloat16) for h in (H_Q, H_KV, H_KV))
        out_shape = (tokens, H_Q, D)
    else:  # transformers' layout: (B, S, H, D) leaves, seen as (B, H, S, D)
        q, k, v = (torch.randn(DENSE_B, DENSE_S, h, D, device="cuda", dtype=torch.bfloat16) for h in (H_Q, H_KV, H_KV))
        out_shape = (DENSE_B, DENSE_S, H_Q, D)
    sinks = 2 * torch.randn(H_Q, device="cuda")
    grad = torch.randn(out_shape, device="cuda", dtype=torch.bfloat16)
    return *(t.requires_grad_() for t in (q, k, v, sinks)), grad


def _fresh(q, k, v, sinks):
    for t in (q, k, v, sinks):
        t.grad = None


def _results(out, q, k, v, sinks) -> dict:
    # The leaves' gradients after out.backward: in the leaves' own layout whatever view the implementation took.
    return dict(out=out.detach(), dq=q.grad.clone(), dk=k.grad.clone(), dv=v.grad.clone(), dsinks=sinks.grad.clone())


def _cu():
    return torch.tensor([0, *itertools.accumulate(DOCS)], dtype=torch.int32, device="cuda")


def run_cudnn(layout, window, q, k, v, sinks, grad, sink_forward):
    import cudnn_attention
    from cudnn_attention import cudnn_graphs, plan

    if plan.sink_forward() != sink_forward:  # the graphs built for the other choice are not needed again
        plan.sink_forward = lambda: sink_forward
        cudnn_graphs.clear_cache()
    cudnn_attention.reset_stats()
    if layout == "packed":
        cu = _cu()
        out = cudnn_attention.varlen_attention(q, k, v, cu, cu, max(DOCS), max(DOCS), causal=True, window_size=window, sinks=sinks)
    else:
        out = cudnn_attention.attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=window, sinks=sinks
        ).transpose(1, 2)
    out.backward(grad)
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] and stats["cudnn_backward"] and not stats["fallback_forward"], stats
    return _results(out, q, k, v, sinks)


def run_fa4(fa4, layout, window, q, k, v, sinks, grad):
    window = tuple(None if side < 0 else side for side in window)  # FA4 spells an unbounded side None, not -1
    if layout == "packed":
        cu = _cu()
        out, _ = fa4.flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max(DOCS),
            max_seqlen_k=max(DOCS),
            causal=True,
            window_size=window,
            learnable_sink=sinks,
        )
    else:
        out, _ = fa4.flash_attn_func(q, k, v, causal=True, window_size=window, learnable_sink=sinks)
    out.backward(grad)
    return _results(out, q, k, v, sinks)


def _eager_bshd(q, k, v, sinks, window, dtype):
    """transformers' gpt-oss eager attention on (B, S, H, D) in ``dtype``: scores, the sink logit, softmax, P @ V."""
    B, S, _, _ = q.shape
    q_, k_, v_ = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    k_, v_ = (t.repeat_interleave(H_Q // H_KV, dim=1) for t in (k_, v_))
    scores = q_ @ k_.transpose(-1, -2) * D**-0.5
    i = torch.arange(S, device=q.device)
    visible = i.view(-1, 1) >= i.view(1, -1)
    if window[0] >= 0:
        visible &= i.view(-1, 1) - i.view(1, -1) <= window[0]
    scores = scores.masked_fill(~visible, float("-inf"))
    logits = torch.cat([scores, sinks.to(dtype).view(1, -1, 1, 1).expand(B, -1, S, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return (probs @ v_).transpose(1, 2)


def run_eager(layout, window, q, k, v, sinks, grad, dtype=torch.bfloat16):
    if layout == "packed":
        bounds = itertools.pairwise([0, *itertools.accumulate(DOCS)])
        pieces = [_eager_bshd(q[a:b][None], k[a:b][None], v[a:b][None], sinks, window, dtype)[0] for a, b in bounds]
        out = torch.cat(pieces)
    else:
        out = _eager_bshd(q, k, v, sinks, window, dtype)
    out.backward(grad.to(out.dtype))
    return _results(out, q, k, v, sinks)


def run_reference(layout, window, q, k, v, sinks, grad):
    """float64 ground truth from the tests' independent reference."""
    from support.reference64 import reference_attention, reference_varlen_attention

    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks64 = sinks.detach().double().requires_grad_()
    if layout == "packed":
        cu = _cu()
        out = reference_varlen_attention(q, k, v, cu, cu, causal=True, window_size=window, sinks=sinks64)
    else:
        out = reference_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=window, sinks=sinks64
        ).transpose(1, 2)
    out.backward(grad.double())
    return _results(out, q, k, v, sinks64)


def _milliseconds(fn, iters=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for sink_accuracy.md / .json")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--time", action="store_true", help="also time forward+backward (median of 30)")
    args = parser.parse_args(argv)
    fa4 = _fa4()
    import cudnn

    versions = f"torch {torch.__version__}, cuDNN {cudnn.backend_version()}, frontend {cudnn.__version__}, {torch.cuda.get_device_name()}"
    impls = {"cudnn fold": lambda *a: run_cudnn(*a, "fold"), "cudnn engine": lambda *a: run_cudnn(*a, "engine"), "eager bf16": run_eager}
    if fa4 is not None:
        impls["flash_attention_4"] = lambda *a: run_fa4(fa4, *a)
    rows = []
    for layout, (mask, window) in itertools.product(("packed", "dense"), MASKS.items()):
        errors = {name: {what: [] for what in TENSORS} for name in impls}
        for seed in range(args.seeds):
            q, k, v, sinks, grad = inputs(layout, seed)
            ref = run_reference(layout, window, q, k, v, sinks, grad)
            for name, fn in impls.items():
                _fresh(q, k, v, sinks)
                got = fn(layout, window, q, k, v, sinks, grad)
                for what in TENSORS:
                    errors[name][what].append((got[what].double() - ref[what]).abs().max().item())
            del ref
        base = {what: max(errors["eager bf16"][what]) for what in TENSORS}
        for name in impls:
            row = {"layout": layout, "mask": mask, "implementation": name}
            for what in TENSORS:
                row[what] = max(errors[name][what])
                row[f"{what} x eager"] = row[what] / base[what]
            if args.time and name != "eager bf16":
                q, k, v, sinks, grad = inputs(layout, 0)
                row["fwd+bwd ms"] = _milliseconds(lambda: (_fresh(q, k, v, sinks), impls[name](layout, window, q, k, v, sinks, grad)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        f"# Sink accuracy at gpt-oss's attention shape ({versions})",
        "",
        f"max |error| against float64 over {args.seeds} seeds; x eager = a multiple of transformers' gpt-oss eager attention in bf16",
        "",
        "| layout | mask | implementation |"
        + "".join(f" {label} | {label} x eager |" for label in TENSORS.values())
        + (" fwd+bwd ms |" if args.time else ""),
        "|---|---|---|" + "---|---|" * len(TENSORS) + ("---|" if args.time else ""),
    ]
    for r in rows:
        timing = f" {r['fwd+bwd ms']:.3f} |" if "fwd+bwd ms" in r else (" |" if args.time else "")
        errors_text = "".join(f" {r[what]:.4g} | {r[f'{what} x eager']:.2f} |" for what in TENSORS)
        lines.append(f"| {r['layout']} | {r['mask']} | {r['implementation']} |{errors_text}{timing}")
    if fa4 is None:
        lines += ["", "flash_attention_4: not installed here (flash_attn.cute did not import)."]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sink_accuracy.md").write_text(report + "\n")
        (args.out / "sink_accuracy.json").write_text(json.dumps({"versions": versions, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
