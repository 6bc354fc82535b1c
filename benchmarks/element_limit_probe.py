"""Where a packed call past 2**31 elements of q goes wrong, per document: the diagnosis behind errata entry
``backward-past-2**31-elements`` (docs/decisions/0024-backward-past-2-31-elements.md).

    python3 benchmarks/element_limit_probe.py [DOCS DOC H H_KV]   (default: 516 documents of 1,024 tokens, H 64/8, D 64)
    python3 benchmarks/element_limit_probe.py 6 64 8 2             (a CPU: the exact path, the script's plumbing)

Runs the call as it ran before the workaround (the entry taken out of the table, so no head groups): whole with sinks,
whole without, the first half of the heads as views of the same tensors (which varlen_attention copies compact, as it
does any packed operand that is not: layouts.token_major), and as copies made here. For each, and each
document on either side of elements 2**29, 2**30 and 2**31 of q, it prints error / bound by the tests' rule (the fp32
reference of that document alone; above 1 fails) of out, dq, dk and dv. Results: benchmarks/results/backward_past_2_31_*.
"""

import sys

import torch

import cudnn_attention
from cudnn_attention import errata
from cudnn_attention.masking import MaskSpec
from cudnn_attention.reference import varlen_reference
from cudnn_attention.tolerance import noise_bound

errata.ERRATA = tuple(e for e in errata.ERRATA if e.key != "backward-past-2**31-elements")
DOCS, DOC, H, H_KV = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (516, 1024, 64, 8)
D, LEFT = 64, 127
T = DOC * DOCS
dev = "cuda" if torch.cuda.is_available() else "cpu"
print(f"T {T} H {H}/{H_KV} D {D}: q elements {T * H * D} (2**31 = {2**31})", flush=True)
torch.manual_seed(0)
bf16 = dict(device=dev, dtype=torch.bfloat16)
q0 = torch.randn(T, H, D, **bf16)
k0 = torch.randn(T, H_KV, D, **bf16)
v0 = torch.randn(T, H_KV, D, **bf16)
sinks0 = torch.randn(H, device=dev)
grad_out0 = torch.randn(T, H, D, **bf16)
cu = torch.arange(0, DOCS + 1, device=dev, dtype=torch.int32) * DOC
one = torch.tensor([0, DOC], device=dev, dtype=torch.int32)
mask = MaskSpec(left=LEFT, right=0, bottom_right=False)
per_doc = H * D * DOC
marks = sorted({0, 1, DOCS - 1} | {m for b in (2**29, 2**30, 2**31) for m in (b // per_doc - 1, b // per_doc) if 0 <= m < DOCS})


def run(label, heads, contiguous, with_sinks):
    h, hk = heads
    leaves = [t[:, :n] for t, n in zip((q0, k0, v0), (h, hk, hk))]
    if contiguous:
        leaves = [t.contiguous() for t in leaves]
    leaves = [t.detach().requires_grad_() for t in leaves]
    sinks = sinks0[:h].clone().requires_grad_() if with_sinks else None
    grad_out = grad_out0[:, :h]
    cudnn_attention.reset_stats()
    try:
        out = cudnn_attention.varlen_attention(*leaves, cu, cu, DOC, DOC, causal=True, window_size=(LEFT, 0), sinks=sinks)
        grads = torch.autograd.grad(out, leaves, grad_out)
        if dev == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a diagnosis: say it and go on
        print(f"{label}: raised {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return
    stats = cudnn_attention.stats()
    got = (out, *grads)
    print(
        f"{label}: cudnn fwd {stats['cudnn_forward']} bwd {stats['cudnn_backward']} "
        f"fallbacks {stats['fallback_forward']} {stats['fallback_backward']}; nan {[bool(t.isnan().any()) for t in got]}",
        flush=True,
    )
    for doc in marks:
        rows = slice(doc * DOC, (doc + 1) * DOC)
        res = {}
        for dtype in (torch.float32, torch.bfloat16):
            ls = [t.detach()[rows].clone().requires_grad_() for t in leaves]
            ref, _ = varlen_reference(
                *ls, one, one, DOC, DOC, scale=D**-0.5, mask=mask, sinks_H=None if sinks is None else sinks.detach(), compute_dtype=dtype
            )
            res[dtype] = (ref, *torch.autograd.grad(ref, ls, grad_out[rows].to(ref.dtype)))
        ratios = []
        for mine, ref, lowp in zip(got, res[torch.float32], res[torch.bfloat16]):
            err = (mine[rows].float() - ref.float()).abs().max().item()
            base = (lowp.float() - ref.float()).abs().max().item()
            ratios.append(err / noise_bound(base, ref.float().abs().max().item()))
        first_q = doc * per_doc
        print(
            f"  doc {doc:4d} (q elements from {first_q:>11,}; bytes {2 * first_q:>14,}): "
            + " ".join(f"{n} {r:7.3f}" for n, r in zip(("out", "dq", "dk", "dv"), ratios)),
            flush=True,
        )
    del out, grads, got, leaves
    if dev == "cuda":
        torch.cuda.empty_cache()


run("one call, sinks", (H, H_KV), False, True)
run("one call, no sinks", (H, H_KV), False, False)
run("half the heads, views (varlen_attention copies them compact)", (H // 2, H_KV // 2), False, True)
run("half the heads, contiguous copies", (H // 2, H_KV // 2), True, True)
