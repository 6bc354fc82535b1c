"""Which graph kinds show the loaded cuDNN's non-finite-gradient bugs: every kind the package builds, on adversarial rows,
with the errata reroute off (the graph a call would get without the table) and on (the graph it gets).

    python3 benchmarks/errata_sweep.py [--quick] [--out benchmarks/results]

Each case anti-aligns every query row with every key (``tests/support/adversarial.py``: every score near -100, so a row's
log-sum-exp is below -88.7, where ``exp`` underflows in float32), runs one forward and backward through cudnn_attention
and records which of dQ, dK, dV, dSink holds a NaN or an infinity where the float64 math has none. Kinds: dense, padded
(the last row a quarter short) and packed (two documents); no mask, causal (top-left and, with S_q != S_kv,
bottom-right), a left window, a two-sided band and a band wider than any row; with and without sinks; MHA and GQA;
D 64 and 128 over key lengths 64 mod 128 (192, 576), 0 mod 128 (256) and neither (200), plus D 32, 192 and 256
unmasked; and single-query rows (S_q = 1) over the same key lengths. A kind the reroute leaves broken is a wrong result
reaching users: the sweep exits 1. The table is what an errata entry's class and versions are written from
(``cudnn_attention.errata``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' adversarial draw: `support.adversarial`

import cudnn_attention  # noqa: E402
from attention_kernels import write_table  # noqa: E402 (this folder is on sys.path when run)
from cudnn_attention import cudnn_graphs, errata, graph_spec  # noqa: E402
from cudnn_attention.environment import versions  # noqa: E402
from cudnn_attention.frontend import cudnn_version  # noqa: E402
from support.adversarial import anti_align  # noqa: E402

MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "causal bottom-right": dict(causal=True, bottom_right=True),
    "window (64, 0)": dict(window_size=(64, 0)),
    "band (8, 300)": dict(window_size=(8, 300)),
    # A band wider than any row: the same math as no mask, in a graph with a band mask (a candidate reroute, cheaper than
    # the padded graph if it is clean: benchmarks/errata_cost.py times it).
    "band over every key": dict(window_size=(1 << 20, 1 << 20)),
}
KEY_LENGTHS = (192, 576, 256, 200)  # 64, 64, 0 and 72 mod 128


def cases(quick: bool, masks=tuple(MASKS)):
    """``(layout, mask, sinks, D, H, H_kv, S_q, S_kv)`` for every kind the sweep runs (``masks``: the first group's)."""
    key_lengths = KEY_LENGTHS[:3] if quick else KEY_LENGTHS
    for layout, mask, sinks, D, (H, H_kv), S_kv in itertools.product(
        ("dense", "padded", "packed"), masks, (False, True), (64, 128), ((4, 4), (4, 2)), key_lengths
    ):
        S_q = S_kv // 2 if MASKS[mask].get("bottom_right") else S_kv
        yield layout, mask, sinks, D, H, H_kv, S_q, S_kv
    for layout, D, S_kv in itertools.product(("dense", "padded", "packed"), (32, 192, 256), key_lengths):
        yield layout, "none", False, D, 4, 2, S_kv, S_kv
    for layout, sinks, S_kv in itertools.product(("dense", "padded", "packed"), (False, True), key_lengths):
        yield layout, "none", sinks, 64, 2, 2, 1, S_kv


def _inputs(layout, sinks, D, H, H_kv, S_q, S_kv, *, device):
    """Adversarial leaves and the call's arguments: ``(leaves, args, kwargs)``."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    target = 100.0 + torch.tensor(float(S_kv)).log().item()
    # A sink far below the rows' scores: the row's log-sum-exp stays below -88.7 and the sink passes still run.
    sink = torch.full((H,), -2 * target, device=device, requires_grad=True) if sinks else None
    if layout == "packed":
        # Two documents of each side's length: the second one starts mid-tile.
        q = torch.randn(2 * S_q, H, D, **bf16)
        k, v = (torch.randn(2 * S_kv, H_kv, D, **bf16) for _ in range(2))
        anti_align(q, k, scale=D**-0.5, target=target, rows="all", generator=generator, packed=True)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        cu_q = torch.tensor([0, S_q, 2 * S_q], device=device, dtype=torch.int32)
        cu_kv = torch.tensor([0, S_kv, 2 * S_kv], device=device, dtype=torch.int32)
        return (*leaves, sink), ("varlen", (*leaves, cu_q, cu_kv, S_q, S_kv)), {"sinks": sink}
    q = torch.randn(2, H, S_q, D, **bf16)
    k, v = (torch.randn(2, H_kv, S_kv, D, **bf16) for _ in range(2))
    anti_align(q, k, scale=D**-0.5, target=target, rows="all", generator=generator, packed=False)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    kwargs = {"sinks": sink}
    if layout == "padded":
        kwargs["seqlens_q"] = torch.tensor([S_q, max(1, S_q - S_q // 4)], device=device, dtype=torch.int32)
        kwargs["seqlens_kv"] = torch.tensor([S_kv, S_kv - S_kv // 4], device=device, dtype=torch.int32)
    return (*leaves, sink), ("dense", tuple(leaves)), kwargs


def non_finite(layout, mask, sinks, D, H, H_kv, S_q, S_kv, *, reroute: bool, device="cuda") -> tuple[str, bool]:
    """``(found, rerouted)``: the gradients with a NaN or an infinity (``"dq dk"``), ``"-"`` for none, or the error the
    call raised; and whether the errata table changed one of its graphs (with ``reroute``)."""
    leaves, (api, args), kwargs = _inputs(layout, sinks, D, H, H_kv, S_q, S_kv, device=device)
    function = cudnn_attention.varlen_attention if api == "varlen" else cudnn_attention.attention
    around, changed = graph_spec._around_errata, []

    def recorded(spec):
        served = around(spec)
        changed.append(served != spec)
        return served

    graph_spec._around_errata = recorded if reroute else (lambda spec: spec)
    cudnn_graphs.clear_cache()  # graphs built under the other setting must not serve this call
    try:
        out = function(*args, **MASKS[mask], **kwargs)
        targets = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(out, targets, torch.randn_like(out))
    except Exception as exc:  # noqa: BLE001 - a refused or failing graph is a row of the table too
        return f"raised {type(exc).__name__}", any(changed)
    finally:
        graph_spec._around_errata = around
    bad = [name for name, grad in zip(("dq", "dk", "dv", "dsinks"), grads) if not bool(torch.isfinite(grad).all())]
    return " ".join(bad) or "-", any(changed)


def _first_group(every):
    """The cases of :func:`cases`' first group (layouts x masks x sinks x D x heads x lengths) only."""
    return (case for case in every if not (case[3] in (32, 192, 256) or case[6] == 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three key lengths (192, 256, 576) instead of four")
    parser.add_argument("--out", type=Path, help="also write the table to OUT/errata_sweep.md")
    parser.add_argument("--mask", action="append", choices=list(MASKS), help="only these masks (repeatable), and no D, single-query rows")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the exact path, for the script's own test
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/errata_sweep.py runs cuDNN graphs and needs a CUDA GPU; none is visible here.")
    found = versions()
    lines = [
        f"Non-finite gradients on adversarial rows (every score near -100): torch {found['torch']}, cuDNN "
        f"{errata.version_text(cudnn_version())} (frontend {found['cudnn_frontend']}), bf16. Listed: kinds with a non-finite gradient "
        "either way, or whose graph the table changes.",
        "",
        "| layout | mask | sinks | D | H/H_kv | S_q, S_kv | reroute off | reroute on (served) | rerouted | served by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # Rows print as they are found: a run cut short by a device call's time limit still leaves what it measured.
    print("\n".join(lines), flush=True)
    counted = {"kinds": 0, "rerouted": 0, "broken without the table": 0, "broken as served": 0}
    every = cases(args.quick) if args.mask is None else _first_group(cases(args.quick, tuple(args.mask)))
    tail = []
    try:
        _sweep(every, counted, lines, device=args.device)
    except KeyboardInterrupt:  # `timeout -s INT`: a device call's limit; the counts say how far it got
        tail += ["", f"cut short after {counted['kinds']} kinds"]
    tail += ["", ", ".join(f"{name}: {count}" for name, count in counted.items())]
    lines += tail
    print("\n".join(tail))
    write_table(lines, args.out, "errata_sweep.md")
    return 1 if counted["broken as served"] else 0


def _sweep(every, counted, lines, *, device):
    """Run each case, count it in ``counted`` and append (and print) a row for every listed kind."""
    for case in every:
        cudnn_attention.reset_stats()
        served, rerouted = non_finite(*case, reroute=True, device=device)
        stats = cudnn_attention.stats()
        path = "cuDNN" if stats["cudnn_backward"] and not stats["fallback_backward"] else "exact path"
        # Where the table changed no graph, the call without it is the same call.
        off = non_finite(*case, reroute=False, device=device)[0] if rerouted else served
        counted["kinds"] += 1
        counted["rerouted"] += rerouted
        counted["broken without the table"] += off != "-"
        counted["broken as served"] += served != "-"
        if off != "-" or served != "-" or rerouted:
            layout, mask, sinks, D, H, H_kv, S_q, S_kv = case
            row = f"| {layout} | {mask} | {'yes' if sinks else 'no'} | {D} | {H}/{H_kv} | {S_q}, {S_kv} | {off} | {served} |"
            lines.append(f"{row} {'yes' if rerouted else 'no'} | {path} |")
            print(lines[-1], flush=True)


if __name__ == "__main__":
    sys.exit(main())
