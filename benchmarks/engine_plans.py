"""Does another cuDNN engine plan beat the heuristic's first choice for long dense causal forwards and backwards?

    python3 benchmarks/engine_plans.py

Builds the forward and the backward graph with the frontend's public API, every plan heuristics A and B and the fallback list
offer, and times each (CUDA events, the median of 5 means of 10 calls, after 3 warm-up). cudnn_attention runs plan 0 (the heuristic's
first choice); on an H200 (cuDNN 9.19) it was the fastest at S=8192 and 16384, forward (of four plans) and backward
(of two).
"""

import torch

if not torch.cuda.is_available():
    raise SystemExit("benchmarks/engine_plans.py times cuDNN plans and needs a CUDA GPU; none is visible here.")

import cudnn  # noqa: E402

from attention_kernels import cuda_time_ms  # noqa: E402  (this folder is on sys.path when the script runs)


def _new_graph(handle):
    return cudnn.pygraph(
        handle=handle,
        io_data_type=cudnn.data_type.BFLOAT16,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )


def _time_every_plan(g, pack: dict, handle, title: str, flops: float) -> None:
    """Build every plan heuristics A and B and the fallback list offer for ``g`` and time each."""
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)
    n = g.get_execution_plan_count()
    ws = torch.empty(max(g.get_workspace_size_plan_at_index(i) for i in range(n)), device="cuda", dtype=torch.uint8)
    rows = []
    for i in range(n):
        try:
            t = cuda_time_ms(lambda: g.execute_plan_at_index(pack, ws, i, handle=handle), warmup=3, samples=5, calls_per_sample=10)
            rows.append((t, g.get_plan_name_at_index(i)))
        except Exception as exc:
            rows.append((float("inf"), f"{g.get_plan_name_at_index(i)} failed: {str(exc)[:60]}"))
    print(f"{title}: {n} plans; plan 0 is the heuristic's first choice")
    for i, (t, name) in enumerate(rows):
        print(f"  plan {i}: {name:30s} {t:.3f} ms  {flops / t / 1e9:.0f} TF/s")


def bench(S, B, H, Hkv, D):
    """Every forward plan, then every backward plan (on the forward's O and statistics), of one causal shape."""
    handle = cudnn.create_handle()
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    stats = torch.empty(B, H, S, 1, device="cuda", dtype=torch.float32)
    causal = {"attn_scale": D**-0.5, "diagonal_band_right_bound": 0, "diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT}
    flops = 4 * B * H * D * S * (S + 1) / 2
    shape = f"S={S} B={B} H={H}/{Hkv} D={D}"

    g = _new_graph(handle)
    tq, tk, tv = (g.tensor_like(t) for t in (q, k, v))
    out, st = g.sdpa(q=tq, k=tk, v=tv, generate_stats=True, **causal)
    out.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride()))
    st.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(list(stats.shape)).set_stride(list(stats.stride()))
    _time_every_plan(g, {tq: q, tk: k, tv: v, out: o, st: stats}, handle, f"forward {shape}", flops)

    # The last plan timed above wrote o and stats: the backward reads a real forward's output.
    d_o = torch.randn_like(o)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    g = _new_graph(handle)
    tq, tk, tv, to, tdo, tst = (g.tensor_like(t) for t in (q, k, v, o, d_o, stats))
    gq, gk, gv = g.sdpa_backward(q=tq, k=tk, v=tv, o=to, dO=tdo, stats=tst, **causal)
    for grad, like in ((gq, dq), (gk, dk), (gv, dv)):
        grad.set_output(True).set_dim(list(like.shape)).set_stride(list(like.stride()))
    pack = {tq: q, tk: k, tv: v, to: o, tdo: d_o, tst: stats, gq: dq, gk: dk, gv: dv}
    _time_every_plan(g, pack, handle, f"backward {shape}", 2.5 * flops)


DEFAULT_SHAPES = [
    (8192, 1, 32, 8, 128),
    (16384, 1, 32, 8, 128),
    (8192, 1, 64, 8, 128),  # NVIDIA's own H200 table for cuDNN 9.19.1 (frontend repository, sdpa_benchmark_training)
    (2048, 4, 16, 4, 64),
]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=[], help="S,B,H,H_kv,D (repeatable); default: DEFAULT_SHAPES")
    args = parser.parse_args()
    shapes = []
    for text in args.shape:
        try:
            S, B, H, H_kv, D = (int(n) for n in text.split(","))
        except ValueError:
            parser.error(f"--shape takes five integers S,B,H,H_kv,D, got {text!r}")
        shapes.append((S, B, H, H_kv, D))
    print(f"cuDNN {cudnn.backend_version()} under frontend {cudnn.__version__}, torch {torch.__version__}")
    for shape in shapes or DEFAULT_SHAPES:
        bench(*shape)
