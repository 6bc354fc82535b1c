"""Does another cuDNN engine plan beat the heuristic's first choice for long dense causal forwards?

    python3 benchmarks/engine_plans.py

Builds the forward graph with the frontend's public API, every plan heuristics A and B and the fallback list
offer, and times each (CUDA events, 10 calls after 3 warm-up). cudnn_attention runs plan 0 (the heuristic's
first choice); on an H200 (cuDNN 9.19) it was the fastest at S=8192 and 16384.
"""

import torch

if not torch.cuda.is_available():
    raise SystemExit("benchmarks/engine_plans.py times cuDNN plans and needs a CUDA GPU; none is visible here.")

import cudnn  # noqa: E402
from attention_kernels import cuda_time_ms  # noqa: E402  (this folder is on sys.path when the script runs)


def bench(S, B, H, Hkv, D):
    handle = cudnn.create_handle()
    g = cudnn.pygraph(handle=handle, io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    stats = torch.empty(B, H, S, 1, device="cuda", dtype=torch.float32)
    tq, tk, tv = (g.tensor_like(t) for t in (q, k, v))
    out, st = g.sdpa(q=tq, k=tk, v=tv, generate_stats=True, attn_scale=D ** -0.5, diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)
    out.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride()))
    st.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(list(stats.shape)).set_stride(list(stats.stride()))
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK]); g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)
    n = g.get_execution_plan_count()
    ws = torch.empty(max(g.get_workspace_size_plan_at_index(i) for i in range(n)), device="cuda", dtype=torch.uint8)
    pack = {tq: q, tk: k, tv: v, out: o, st: stats}
    flops = 4 * B * H * D * S * (S + 1) / 2
    rows = []
    for i in range(n):
        try:
            t = cuda_time_ms(lambda: g.execute_plan_at_index(pack, ws, i, handle=handle), warmup=3, samples=1, calls_per_sample=10)
            rows.append((t, g.get_plan_name_at_index(i)))
        except Exception as exc:
            rows.append((float("inf"), f"{g.get_plan_name_at_index(i)} failed: {str(exc)[:60]}"))
    print(f"forward S={S} B={B} H={H}/{Hkv} D={D}: {n} plans; plan 0 is the heuristic's first choice")
    for i, (t, name) in enumerate(rows):
        print(f"  plan {i}: {name:30s} {t:.3f} ms  {flops / t / 1e9:.0f} TF/s")


if __name__ == "__main__":
    bench(8192, 1, 32, 8, 128)
    bench(16384, 1, 32, 8, 128)
