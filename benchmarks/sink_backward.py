"""cuDNN's own dSink (the frontend's ``dSink_token``) against the identity cudnn_attention serves, on the graphs it serves.

    python3 benchmarks/sink_backward.py [--out benchmarks/results]

Two ways to get dSink: the sink-less backward and then ``-sum_rows exp(sink - lse) * rowsum(dO * O)``
(``fused_sinks.sink_gradient``, one more pass over O and dO), or the backward graph holding the sinks (the frontend's
``dSink_token``: sinks in, dSink out), whose dO.O pass reads both anyway. cudnn_attention serves the second for dense
calls on cuDNN >= 9.28.1 and the first elsewhere (``graph_spec.dsink_in_graph``). For each case one forward and backward
runs through cudnn_attention while its launches are recorded; the served backward's spec is then built both ways and
launched on the same operands. Columns: the way served, dSink's largest error against float64 as served, by the pass,
and by cuDNN (with either sign: the frontend's composite form was read as summing ``exp(sink - stats) * D`` without a
minus), the flash-style noise (exact O rounded to bf16: FlashAttention's rule allows twice it), whether dQ/dK/dV of the
two graphs are bit-identical, and the time of the launch plus the pass against the one launch. Accuracy runs at
a quarter of each case's length (the float64 reference holds every score); timing at the full length. A graph the loaded
cuDNN refuses (TransformerEngine#3249: packed, before 9.26) or rejects says so in its row.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    raise SystemExit("benchmarks/sink_backward.py launches cuDNN graphs and needs a CUDA GPU; none is visible here.")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' float64 reference: `support.reference64`

from engine_plans import recorded_launches  # noqa: E402

from attention_kernels import CASES, Case, cuda_time_ms, cudnn_attention_call, make_inputs, write_table  # noqa: E402 (this folder is on sys.path when run)
from cudnn_attention import errata, graph_build, launch  # noqa: E402
from cudnn_attention.environment import versions  # noqa: E402
from cudnn_attention.frontend import cudnn_version  # noqa: E402
from cudnn_attention.fused_sinks import sink_gradient  # noqa: E402
from support.reference64 import flash_style_dsinks, reference_attention, reference_varlen_attention  # noqa: E402

BY_NAME = {case.name: case for case in CASES}
SELECTED = [
    BY_NAME["packed gpt-oss 8 x 2048 window 128 sinks"],
    BY_NAME["packed gpt-oss 8 x 2048 sinks"],
    Case("dense gpt-oss B=2 S=4096 window 128 sinks bshd", 64, 8, 64, [4096] * 2, False, left=128, sinks=True),
    Case("dense gpt-oss B=2 S=4096 sinks bshd", 64, 8, 64, [4096] * 2, False, sinks=True),
]


def served_backward(case: Case, seed: int = 0):
    """``(graph, operands, inputs, grad_out)`` of the backward launch one served step makes."""
    q, k, v, sinks, cu = inputs = make_inputs(case, seed)
    with recorded_launches() as launches:
        out = cudnn_attention_call(case, q, k, v, sinks, cu)()
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    ((graph, operands),) = [(g, ops) for g, ops in launches if g.spec.direction == "backward"]
    return graph, operands, inputs, grad_out


def both_ways(graph, operands: list, sinks):
    """The served backward's two variants, each with its operands: ``(sink-less graph, its operands)`` (dSink from the
    pass after it) and ``(graph holding the sinks, its operands, its dSink buffer)``. The served graph is one of them
    (``graph_spec.dsink_in_graph``); the other is built from its spec, with fresh dQ/dK/dV."""
    lengths = operands[11:] if graph.has_sinks else operands[9:]
    grads = [torch.empty_like(t) for t in operands[6:9]]
    dsinks = torch.empty(sinks.shape[0], device="cuda", dtype=torch.float32)
    sinkless = graph_build.build(graph.spec._replace(sinks=False))
    holding = graph_build.build(graph.spec._replace(sinks=True))
    return (
        (sinkless, [*operands[:9], *lengths]),
        (holding, [*operands[:6], *grads, sinks.detach().contiguous(), dsinks, *lengths], dsinks),
    )


def accuracy(case: Case) -> dict:
    small = dataclasses.replace(case, doc_lengths=[n // 4 for n in case.doc_lengths], results={})
    graph, operands, (q, k, v, sinks, cu), grad_out = served_backward(small)
    (sinkless, plain_ops), (holding, ops, dsinks) = both_ways(graph, operands, sinks)
    launch.execute(sinkless, plain_ops, graph.spec.device_index)
    passed = sink_gradient(plain_ops[4], plain_ops[3], plain_ops[5], sinks.detach())
    launch.execute(holding, ops, graph.spec.device_index)
    torch.cuda.synchronize()
    sinks64 = sinks.detach().double().requires_grad_()
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    window = (case.left, 0)
    if case.packed:
        out64, lse64 = reference_varlen_attention(q64, k64, v64, cu, cu, causal=True, window_size=window, sinks=sinks64, return_lse=True)
    else:
        out64, lse64 = reference_attention(q64, k64, v64, causal=True, window_size=window, sinks=sinks64, return_lse=True)
    (ref,) = torch.autograd.grad(out64, sinks64, grad_out.double())
    scale = ref.abs().max().item()
    flash = flash_style_dsinks(out64, lse64, grad_out, sinks64.detach(), torch.bfloat16).double()
    return {
        "served": (sinks.grad.double() - ref).abs().max().item() / scale,
        "pass": (passed.double() - ref).abs().max().item() / scale,
        "cudnn": (dsinks.double() - ref).abs().max().item() / scale,
        "cudnn negated": (-dsinks.double() - ref).abs().max().item() / scale,
        "flash-style": (flash - ref).abs().max().item() / scale,
        "same dq/dk/dv": all(torch.equal(a, b) for a, b in zip(plain_ops[6:9], ops[6:9])),
        "served way": "in the graph" if graph.has_sinks else "pass",
    }


def timing(case: Case) -> tuple[float, float]:
    graph, operands, (_, _, _, sinks, _), grad_out = served_backward(case)
    (sinkless, plain_ops), (holding, ops, _) = both_ways(graph, operands, sinks)
    index = graph.spec.device_index
    out, lse = operands[3], operands[5]

    def launch_and_pass():
        launch.execute(sinkless, plain_ops, index)
        sink_gradient(plain_ops[4], out, lse, sinks.detach())

    return cuda_time_ms(launch_and_pass), cuda_time_ms(lambda: launch.execute(holding, ops, index))


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table to OUT/sink_backward.md")
    args = parser.parse_args(argv)
    found = versions()
    lines = [
        "dSink in cuDNN's backward graph and by the pass after the sink-less one: "
        f"torch {found['torch']}, cuDNN {errata.version_text(cudnn_version())} "
        f"(frontend {found['cudnn_frontend']}), bf16, causal; errors relative to max|dSink| (a quarter of each length); "
        "backward ms (median of 15 means of 10 launches)",
        "",
        "| case | served | served error | pass error | cuDNN's error | negated | flash-style | dQ/dK/dV identical "
        "| launch + pass ms | cuDNN's ms | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in SELECTED:
        try:
            error = accuracy(case)
            served_ms, cudnn_ms = timing(case)
        except Exception as exc:  # noqa: BLE001 - a refused or rejected graph is this case's answer
            lines.append(f"| {case.name} | not built: {str(exc).splitlines()[0][:150]} ||||||||||")
            continue
        lines.append(
            f"| {case.name} | {error['served way']} | {error['served']:.2e} | {error['pass']:.2e} | {error['cudnn']:.2e} "
            f"| {error['cudnn negated']:.2e} | {error['flash-style']:.2e} "
            f"| {'yes' if error['same dq/dk/dv'] else 'no'} | {served_ms:.3f} | {cudnn_ms:.3f} | {served_ms / cudnn_ms:.2f}x |"
        )
    print("\n".join(lines))
    write_table(lines, args.out, "sink_backward.md")
    return lines


if __name__ == "__main__":
    main()
