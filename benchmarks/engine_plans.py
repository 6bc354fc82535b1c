"""Does another cuDNN engine plan beat the one cudnn_attention serves, forward and backward, dense and packed?

    python3 benchmarks/engine_plans.py                                   # the default shapes below
    python3 benchmarks/engine_plans.py --shape 8192,1,64,8,128           # dense S,B,H,H_kv,D (repeatable)
    python3 benchmarks/engine_plans.py --packed "gpt-oss 8 x 2048"       # the packed cases whose name holds this text
    python3 benchmarks/engine_plans.py --implementation auto --implementation unified --implementation composite

Each shape runs one causal forward and backward through cudnn_attention itself while every launch's graph and
operands are recorded; each recorded graph is then built again with every plan heuristics A and B and the fallback
list offer (``graph_build.every_plan``: the same spec, so the same tensors, strides, masks and ragged offsets) and
each plan is timed on the recorded operands (CUDA events, the median of 5 means of 10 calls, after 3 warm-up). Two rows
more per graph: the served plan through the project's own launch (``launch.execute``, the path every call takes), and,
for the forward, the whole public call (``cudnn_attention.attention``/``varlen_attention`` with grad on, which adds the
output allocation and, for sinks, the fold), so a gap between a bare plan and what a user gets is seen where it arises.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

if not torch.cuda.is_available():
    raise SystemExit("benchmarks/engine_plans.py times cuDNN plans and needs a CUDA GPU; none is visible here.")

import cudnn  # noqa: E402

import cudnn_attention  # noqa: E402
from attention_kernels import CASES, Case, cuda_time_ms, make_inputs  # noqa: E402 (this folder is on sys.path when run)
from cudnn_attention import frontend, graph_build, launch  # noqa: E402


@contextlib.contextmanager
def recorded_launches():
    """Every (graph, operands) that ``launch.execute`` runs inside the block, in order."""
    launches, execute = [], launch.execute

    def recording(graph, operands, device_index):
        launches.append((graph, list(operands)))
        execute(graph, operands, device_index)

    launch.execute = recording
    try:
        yield launches
    finally:
        launch.execute = execute


def time_every_plan(graph, operands: list, title: str, flops: float, implementations=("auto",)) -> None:
    """Time each plan of ``graph.spec`` (rebuilt with every plan, once per SDPA ``implementation``) on ``operands``, and
    the served plan as served."""
    print(f"{title}: cudnn_attention serves {graph.plan_name} (implementation {graph.spec.implementation})")
    device_index = graph.spec.device_index
    served = cuda_time_ms(lambda: launch.execute(graph, operands, device_index), warmup=3, samples=5, calls_per_sample=10)
    print(f"  served:  {graph.plan_name:30s} {served:.3f} ms  {flops / served / 1e9:.0f} TF/s  (launch.execute, the project's path)")
    for implementation in implementations:
        try:
            every = graph_build.every_plan(graph.spec._replace(implementation=implementation))
        except Exception as exc:  # noqa: BLE001 - an implementation this cuDNN or frontend lacks says so
            reason = str(exc).splitlines()[0][:160]
            if "incompatible function arguments" in reason:  # frontend 1.32: sdpa takes implementation=, sdpa_backward not
                reason = f"this frontend's binding takes no implementation= here ({reason.split('(')[0]})"
            print(f"  implementation {implementation}: not built: {reason}")
            continue
        _time_plans(every, graph, operands, flops, served, implementation)


def _time_plans(every, graph, operands: list, flops: float, served: float, implementation: str) -> None:
    g, handle = every.graph, frontend.bound_handle(graph.spec.device_index)[0]
    n = g.get_execution_plan_count()
    ws = torch.empty(max([g.get_workspace_size_plan_at_index(i) for i in range(n)] + [1]), device="cuda", dtype=torch.uint8)
    print(f"  implementation {implementation}: {n} plans")
    for i in range(n):
        name = g.get_plan_name_at_index(i)
        try:

            def run(i=i):
                g.execute_plan_at_index(operands, ws, i, handle=handle, tensor_uids=every.uids)

            t = cuda_time_ms(run, warmup=3, samples=5, calls_per_sample=10)
            mark = "  <- served" if name == graph.plan_name and implementation == graph.spec.implementation else ""
            print(f"  plan {i}: {name:30s} {t:.3f} ms  {flops / t / 1e9:.0f} TF/s  ({served / t:.3f}x the served){mark}")
        except Exception as exc:  # noqa: BLE001 - a plan that does not run says so, the others are still timed
            print(f"  plan {i}: {name:30s} failed: {str(exc)[:80]}")


def bench(case: Case, implementations=("auto",)) -> None:
    """Record one forward and backward of ``case`` through cudnn_attention, then time every plan of each graph."""
    q, k, v, sinks, cu = make_inputs(case)
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    max_len, window = max(case.doc_lengths), (case.left, 0)
    if case.packed:

        def call():
            return cudnn_attention.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=True, window_size=window, sinks=sinks)
    else:

        def call():
            return cudnn_attention.attention(q, k, v, causal=True, window_size=window, sinks=sinks)

    forward_flops, backward_flops = case.flops()
    with recorded_launches() as launches:
        out = call()
        torch.autograd.grad(out, inputs, torch.randn_like(out))
    torch.cuda.synchronize()
    whole = cuda_time_ms(call, warmup=3, samples=5, calls_per_sample=10)
    print(f"{case.name}: cudnn_attention forward (grad on, the public call) {whole:.3f} ms  {forward_flops / whole / 1e9:.0f} TF/s")
    seen = set()
    for graph, operands in launches:
        if graph.spec in seen:
            continue
        seen.add(graph.spec)
        flops = forward_flops if graph.spec.direction == "forward" else backward_flops
        time_every_plan(graph, operands, f"{graph.spec.direction} {case.name}", flops, implementations)


DEFAULT_SHAPES = [
    (8192, 1, 32, 8, 128),
    (16384, 1, 32, 8, 128),
    (8192, 1, 64, 8, 128),  # NVIDIA's own H200 table for cuDNN 9.19.1 (frontend repository, sdpa_benchmark_training)
    (2048, 4, 16, 4, 64),
]
DEFAULT_PACKED = "gpt-oss 8 x 2048"


def dense_case(S: int, B: int, H: int, H_kv: int, D: int) -> Case:
    # (B, S, H, D) buffers seen as (B, H, S, D), as transformers hands them over
    return Case(f"dense S={S} B={B} H={H}/{H_kv} D={D}", H, H_kv, D, [S] * B, packed=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=[], help="dense S,B,H,H_kv,D (repeatable)")
    parser.add_argument("--packed", action="append", default=[], help="packed cases of attention_kernels.py whose name holds this text")
    parser.add_argument(
        "--implementation",
        action="append",
        choices=("auto", "composite", "unified"),
        help="cuDNN's SDPA implementation families to build every plan of (repeatable; default auto): cuDNN 9.28's unified "
        "Hopper backward is unified",
    )
    args = parser.parse_args()
    shapes = []
    for text in args.shape:
        try:
            S, B, H, H_kv, D = (int(n) for n in text.split(","))
        except ValueError:
            parser.error(f"--shape takes five integers S,B,H,H_kv,D, got {text!r}")
        shapes.append((S, B, H, H_kv, D))
    if not shapes and not args.packed:
        shapes, args.packed = DEFAULT_SHAPES, [DEFAULT_PACKED]
    cases = [dense_case(*shape) for shape in shapes]
    cases += [case for text in args.packed for case in CASES if case.packed and text in case.name]
    print(
        f"cuDNN {cudnn.backend_version()} under frontend {cudnn.__version__} (torch's: {torch.backends.cudnn.version()}), "
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}"
    )
    for case in cases:
        bench(case, tuple(args.implementation or ("auto",)))


if __name__ == "__main__":
    main()
