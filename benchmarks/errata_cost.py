"""What each erratum's workaround costs: the rerouted graph's fwd+bwd time beside the unaffected graphs at neighbouring
shapes and beside the same shape with the workaround off, measured in one process.

    python3 benchmarks/errata_cost.py                 # the default shapes below
    python3 benchmarks/errata_cost.py --out benchmarks/results

Both reroutes serve an unpadded dense backward with the padded graph (every length full): ``dq-nan-kv-64-mod-128`` at
S_kv = 64 mod 128, ``dkdv-nan-single-query`` at S_q = 1. Rows: for each shape (a vision tower's 576 patches, 1088, 4160,
and one query over 4096 keys), the call as served (``as served``), the same call with the reroute off (``bug's graph``: the
graph that writes NaN on adversarial rows, timed on ordinary data) and the neighbours S_kv - 64 and S_kv + 64, which the
S_kv erratum does not touch. The ratio ``as served / bug's graph`` is the workaround's cost. ``band over every key`` is the
same call with ``window_size=(S_kv, S_kv)``, the reroute off: a graph with a band mask computing the same, the candidate
for a cheaper reroute.
The batches are large enough that the kernels outlast the host work of a call (about 0.23 ms fwd+bwd on the H200): the
first run (B 1 and 2 at S 576 and 1088, 2026-12-05) timed host work, and its two runs gave 1.40x and 0.98x for one shape.
The cuDNN version the frontend loaded is in the header; on a version the table calls unaffected both rows are one graph.
A second table times the errata whose graphs are refused (their calls take the exact path) beside the nearest call cuDNN
serves, and names the path each took. A third times the grid limit's workaround: a batch one past 65,535 served as two
chunks, beside the limit itself (one graph) and beside the exact path that served such batches before the chunks. A
fourth times the element limit's: a packed call past 2**31 elements of q served as head groups, beside the same call
whole (the graph that is wrong below 9.28.1, timed on ordinary data) and beside half of it (about 30 GB at most).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    raise SystemExit("benchmarks/errata_cost.py times cuDNN graphs and needs a CUDA GPU; none is visible here.")

import cudnn_attention  # noqa: E402
from attention_kernels import cuda_time_ms, write_table  # noqa: E402 (this folder is on sys.path when run)
from cudnn_attention import batch_chunks, cudnn_graphs, errata, graph_spec  # noqa: E402
from cudnn_attention.environment import versions  # noqa: E402
from cudnn_attention.frontend import cudnn_version  # noqa: E402

# S_q, S_kv, B, H, H_kv, D (non-causal: encoders, vision towers, cross-attention)
SHAPES = [(576, 576, 64, 16, 16, 64), (1088, 1088, 16, 16, 16, 64), (4160, 4160, 1, 32, 8, 128), (1, 4096, 256, 32, 8, 128)]


def _timed(shape, *, reroute: bool, window=(-1, -1)) -> float:
    around = graph_spec._around_errata
    if not reroute:
        graph_spec._around_errata = lambda spec: spec
    cudnn_graphs.clear_cache()
    try:
        return cuda_time_ms(_call_step("dense", *shape, shape[-1], window=window))  # D_v = D
    finally:
        graph_spec._around_errata = around
        cudnn_graphs.clear_cache()


# The refused graphs' calls take the exact path: each beside the nearest call cuDNN serves (the refused graph itself can
# crash the process or write NaN, so it is not timed). (erratum, the refused call, its neighbour): api, S_q, S_kv (per
# document when packed), B (documents when packed), H, H_kv, D, D_v.
REFUSED = [
    ("bwd-plan-segfault-b1-h1-s1", ("dense", 1, 128, 1, 1, 1, 64, 64), ("dense", 1, 128, 2, 1, 1, 64, 64)),
    ("packed-d256-other-dv-backward", ("packed", 2048, 2048, 2, 8, 8, 256, 128), ("packed", 2048, 2048, 2, 8, 8, 256, 256)),
]


# The grid limit (entry batch-or-heads-over-65535): a vision model's 7 x 7 windows folded into the batch. S, H, D.
GRID_WINDOW = (49, 4, 32)


def _grid_rows() -> list[str]:
    S, H, D = GRID_WINDOW
    rows = []
    for label, B, chunked in (
        ("the limit, whole", errata.GRID_LIMIT, True),
        ("one past it, chunks", errata.GRID_LIMIT + 1, True),
        ("one past it, before the chunks", errata.GRID_LIMIT + 1, False),
    ):
        limited_on = batch_chunks.grid_limited_on
        if not chunked:  # what served it before: the refused graph's fallback
            batch_chunks.grid_limited_on = lambda device_type: False
        try:
            ms, path = _served(_call_step("dense", S, S, B, H, H, D, D))
        finally:
            batch_chunks.grid_limited_on = limited_on
        rows.append((label, B, ms, path))
    per_row = rows[0][2] / rows[0][1]
    return [f"| {label} | {B} | {ms:.3f} | {path} | {ms / B / per_row:.2f}x |" for label, B, ms, path in rows]


# The element limit (entry backward-past-2**31-elements): a gpt-oss-shaped packed call (64 heads x 64) of 516 causal
# documents of 1,024 tokens, past 2**31 elements of q, and half of it, within them. api, S_q, S_kv, B, H, H_kv, D, D_v.
ELEMENT_CALL = ("packed", 1024, 1024, 516, 64, 8, 64, 64)


def _element_rows() -> list[str]:
    half = (*ELEMENT_CALL[:3], ELEMENT_CALL[3] // 2, *ELEMENT_CALL[4:])
    table = errata.ERRATA
    rows = []
    for label, call, grouped in (
        ("half the documents, whole", half, True),
        ("past it, head groups (as served)", ELEMENT_CALL, True),
        ("past it, whole (the bug's graph below 9.28.1)", ELEMENT_CALL, False),
    ):
        if not grouped:
            errata.ERRATA = tuple(e for e in table if e.key != "backward-past-2**31-elements")
        cudnn_graphs.clear_cache()  # no verdict of one table outlives it
        try:
            ms, path = _served(_call_step(*call))
        finally:
            errata.ERRATA = table
            cudnn_graphs.clear_cache()
        rows.append((label, call[3], ms, path))
    per_document = rows[0][2] / rows[0][1]
    return [f"| {label} | {B} | {ms:.3f} | {path} | {ms / B / per_document:.2f}x |" for label, B, ms, path in rows]


def _call_step(api, S_q, S_kv, B, H, H_kv, D, D_v, window=(-1, -1)):
    """A fwd+bwd step of one call (dense: non-causal under ``window``; packed: B causal documents of S_q queries and
    S_kv keys each)."""
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    if api == "packed":
        q = torch.randn(B * S_q, H, D, **bf16, requires_grad=True)
        k = torch.randn(B * S_kv, H_kv, D, **bf16, requires_grad=True)
        v = torch.randn(B * S_kv, H_kv, D_v, **bf16, requires_grad=True)
        cu_q, cu_kv = (torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * S for S in (S_q, S_kv))
        grad = torch.randn(B * S_q, H, D_v, **bf16)

        def call():
            return cudnn_attention.varlen_attention(q, k, v, cu_q, cu_kv, S_q, S_kv, causal=True)
    else:
        q = torch.randn(B, H, S_q, D, **bf16, requires_grad=True)
        k = torch.randn(B, H_kv, S_kv, D, **bf16, requires_grad=True)
        v = torch.randn(B, H_kv, S_kv, D_v, **bf16, requires_grad=True)
        grad = torch.randn(B, H, S_q, D_v, **bf16)

        def call():
            return cudnn_attention.attention(q, k, v, window_size=window)

    return lambda: torch.autograd.grad(call(), (q, k, v), grad)


def _shape_text(call) -> str:
    api, S_q, S_kv, B, H, H_kv, D, D_v = call
    return f"{api}, {S_q}, {S_kv}, {B}, {H}/{H_kv}, {D}/{D_v}"


def _served(step) -> tuple[float, str]:
    """``step``'s time and the path its backward took: the exact path, or ``cuDNN x N`` launches (chunks)."""
    cudnn_attention.reset_stats()
    step()
    stats = cudnn_attention.stats()
    path = "exact path" if stats["fallback_backward"] else f"cuDNN x {stats['cudnn_backward']}"
    return cuda_time_ms(step), path


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table to OUT/errata_cost.md")
    args = parser.parse_args(argv)
    found = versions()
    version = cudnn_version()
    lines = [
        f"{found['gpu']} errata workaround cost: torch {found['torch']}, cuDNN {errata.version_text(version)} "
        f"(frontend {found['cudnn_frontend']}), bf16, non-causal, fwd+bwd ms (median of 15 means of 10 calls)",
        "",
        "| S_q, S_kv, B, H/H_kv, D | as served | bug's graph | ratio | band over every key | S_kv - 64 | S_kv + 64 |",
        "|---|---|---|---|---|---|---|",
    ]
    for S_q, S_kv, *rest in SHAPES:
        served = _timed((S_q, S_kv, *rest), reroute=True)
        bug = _timed((S_q, S_kv, *rest), reroute=False)
        # The same math in a graph with a band mask, as a candidate reroute (errata_sweep.py says whether it is clean).
        band = _timed((S_q, S_kv, *rest), reroute=False, window=(S_kv, S_kv))
        # the neighbours keep one query where the shape has one (that erratum's own condition), else move with S_kv
        below, above = (_timed((1 if S_q == 1 else S, S, *rest), reroute=True) for S in (S_kv - 64, S_kv + 64))
        B, H, H_kv, D = rest
        row = f"| {S_q}, {S_kv}, {B}, {H}/{H_kv}, {D} | {served:.3f} | {bug:.3f} | {served / bug:.2f}x | {band:.3f} |"
        lines.append(f"{row} {below:.3f} | {above:.3f} |")
    lines += [
        "",
        "Refused graphs (the exact path serves their calls on the versions the table names), fwd+bwd ms:",
        "",
        "| erratum | call: api, S_q, S_kv, B, H/H_kv, D/D_v | as served | path | neighbour (its path) | neighbour ms | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, call, neighbour in REFUSED:
        (served, path), (near, near_path) = _served(_call_step(*call)), _served(_call_step(*neighbour))
        shape = _shape_text(call)
        near_shape = _shape_text(neighbour)
        lines.append(f"| {key} | {shape} | {served:.3f} | {path} | {near_shape} ({near_path}) | {near:.3f} | {served / near:.2f}x |")
    S, H, D = GRID_WINDOW
    lines += [
        "",
        f"The grid limit: batches of {S}-token windows (H {H}, D {D}, non-causal), fwd+bwd ms; per row: ms per batch row as a "
        "multiple of the limit's:",
        "",
        "| batch | B | fwd+bwd ms | path | per row |",
        "|---|---|---|---|---|",
        *_grid_rows(),
        "",
        f"The element limit: packed documents of {ELEMENT_CALL[1]} tokens (H {ELEMENT_CALL[4]}/{ELEMENT_CALL[5]}, "
        f"D {ELEMENT_CALL[6]}, causal), fwd+bwd ms; per document: ms per document as a multiple of half the call's:",
        "",
        "| call | documents | fwd+bwd ms | path | per document |",
        "|---|---|---|---|---|",
        *_element_rows(),
    ]
    print("\n".join(lines))
    write_table(lines, args.out, "errata_cost.md")
    return lines


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
