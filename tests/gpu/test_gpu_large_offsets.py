"""A packed call whose tensors pass 2**31 elements, on the GPU: gpt-oss's 64 query heads x 64 per token reach that at
524,288 tokens. Every offset past int32 must land where it should, in cuDNN's ragged graphs (the offsets they are
handed are int64) and in the package's own passes around them (the sink fold and the sink gradient switch to int64
offsets there; tests/unit/test_fused_sinks.py checks them alone). Run in a child process: a wrapped offset may fault.

The first and the last document, and the two on either side of element 2**31 of q, are checked against an fp32
reference of that document alone, forward and backward, by the tests' tolerance rule; documents are independent, so
their rows of the output and of every gradient but the sinks' depend on nothing else.
"""

from pathlib import Path

import pytest

from support.child_process import run_python

pytestmark = pytest.mark.gpu

_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
import cudnn_attention
from cudnn_attention.masking import MaskSpec
from cudnn_attention.reference import varlen_reference
from support.tolerances import assert_within_lowp_noise

H, H_KV, D, DOC, DOCS, LEFT = 64, 8, 64, 1024, 516, 127
T = DOC * DOCS
assert T * H * D > 2**31, T * H * D
torch.manual_seed(0)
bf16 = dict(device="cuda", dtype=torch.bfloat16)
q = torch.randn(T, H, D, **bf16, requires_grad=True)
k = torch.randn(T, H_KV, D, **bf16, requires_grad=True)
v = torch.randn(T, H_KV, D, **bf16, requires_grad=True)
sinks = torch.randn(H, device="cuda", requires_grad=True)
cu = torch.arange(0, DOCS + 1, device="cuda", dtype=torch.int32) * DOC
grad_out = torch.randn(T, H, D, **bf16)
cudnn_attention.reset_stats()
with cudnn_attention.strict():
    out = cudnn_attention.varlen_attention(q, k, v, cu, cu, DOC, DOC, causal=True, window_size=(LEFT, 0), sinks=sinks)
    dq, dk, dv, dsinks = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
torch.cuda.synchronize()
stats = cudnn_attention.stats()
assert stats["cudnn_forward"] == stats["cudnn_backward"] == 1, stats
assert torch.isfinite(dsinks).all(), dsinks
mask = MaskSpec(left=LEFT, right=0, bottom_right=False)
one = torch.tensor([0, DOC], device="cuda", dtype=torch.int32)


def check(label, got, heads):
    # Failures of the first document, the last one below 2**31 elements of q, the one that starts there, and the last.
    failed = []
    at = 2**31 // (DOC * H * D)
    for doc in (0, at - 1, at, DOCS - 1):
        rows = slice(doc * DOC, (doc + 1) * DOC)
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            leaves = [t.detach()[rows, :h].clone().requires_grad_() for t, h in zip((q, k, v), heads)]
            sinks_H = sinks.detach()[: heads[0]]
            ref, _ = varlen_reference(*leaves, one, one, DOC, DOC, scale=D**-0.5, mask=mask, sinks_H=sinks_H, compute_dtype=dtype)
            results[dtype] = (ref, *torch.autograd.grad(ref, leaves, grad_out[rows, : heads[0]].to(ref.dtype)))
        for name, mine, ref, lowp in zip(("out", "dq", "dk", "dv"), got, results[torch.float32], results[torch.bfloat16]):
            try:
                assert_within_lowp_noise(f"{label}: document {doc} {name}", mine[rows], ref, lowp)
            except AssertionError as exc:
                failed.append(str(exc))
    return failed


failed = check("one call", (out, dq, dk, dv), (H, H_KV, H_KV))
if failed:
    # Whether the count of elements is what breaks: the same call on the first half of the heads (and the kv heads they
    # read), whose tensors, and cuDNN's fp32 dQ accumulator, stay below 2**31 elements.
    half = (H // 2, H_KV // 2, H_KV // 2)
    leaves = [t.detach()[:, :h].requires_grad_() for t, h in zip((q, k, v), half)]
    with cudnn_attention.strict():
        sinks_half = sinks.detach()[: half[0]]
        out_half = cudnn_attention.varlen_attention(*leaves, cu, cu, DOC, DOC, causal=True, window_size=(LEFT, 0), sinks=sinks_half)
        grads_half = torch.autograd.grad(out_half, leaves, grad_out[:, : half[0]])
    failed += check("half the heads", (out_half, *grads_half), half) or ["half the heads: no failure"]
# On stdout, every failure at once: a child's stderr ends in the frontend's teardown chatter.
print("\n".join(failed) if failed else "past 2**31 elements: documents on both sides of it and at both ends within the rule")
"""


def test_a_packed_call_past_int32_offsets_is_right_at_both_ends():
    result = run_python(_CHECK, str(Path(__file__).resolve().parents[1]), timeout=600)
    said = result.stdout.strip()
    assert result.returncode == 0 and said.endswith("within the rule"), (result.returncode, said[-3000:] or result.stderr[:3000])
