"""Head groups (errata entry ``backward-past-2**31-elements``) on cuDNN, with the element limit lowered so small calls
are grouped: the public API's packed call with sinks and the provider's varlen op each run as head groups on cuDNN
(strict, launches counted) and match an fp32 reference by the tests' rule. The provider's dense op is
tests/gpu/test_gpu_provider.py's, and the call at the real limit tests/gpu/test_gpu_large_offsets.py's (about 30 GB);
these run the same code paths in a second."""

import pytest
import torch

import cudnn_attention
from cudnn_attention import cudnn_graphs, errata, head_groups
from cudnn_attention.masking import MaskSpec
from cudnn_attention.reference import varlen_reference
from support.tolerances import assert_within_lowp_noise

pytestmark = pytest.mark.gpu
LENGTHS = [100, 37, 256, 64]  # 457 tokens: a backward graph sized for the 512-token bucket


@pytest.fixture
def low_limit(monkeypatch):
    """The element limit at 40,000, on a cuDNN counted as having the entry; graphs and verdicts built under it are
    forgotten after (a refusal kept would send other tests' calls to the exact path)."""
    monkeypatch.setattr(errata, "ELEMENT_LIMIT", 40_000)
    monkeypatch.setattr(head_groups, "element_limited_on", lambda device_type: True)
    cudnn_graphs.clear_cache()
    yield
    cudnn_graphs.clear_cache()


def _check(name, got, reference):
    """``got`` (out and gradients) against ``reference(dtype)``'s in float32, by the rule with its bf16 twin."""
    (ref, *ref_grads), (lowp, *lowp_grads) = reference(torch.float32), reference(torch.bfloat16)
    for tensor, mine, want, base in zip(("out", "dq", "dk", "dv", "dsinks"), got, [ref, *ref_grads], [lowp, *lowp_grads]):
        assert_within_lowp_noise(f"{name} {tensor}", mine, want, base)


@pytest.mark.parametrize("H_kv", [8, 2, 1], ids=["MHA", "GQA-4", "MQA"])
def test_a_packed_call_with_sinks_runs_as_head_groups(low_limit, H_kv):
    # 512 x 8 heads x 64 = 262,144 elements; groups of one head (32,768) are the first that fit: 8 groups. With fewer kv
    # heads the groups of one kv head's queries share it (MQA: all eight), and their dK and dV add up.
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T, H, D = sum(LENGTHS), 8, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(T, heads, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for heads in (H, H_kv, H_kv))
    sinks = torch.randn(H, device="cuda", requires_grad=True)
    grad_out = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    cudnn_attention.reset_stats()
    with cudnn_attention.strict():
        out = cudnn_attention.varlen_attention(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=True, window_size=(31, 0), sinks=sinks)
        grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] == stats["cudnn_backward"] == 8, stats
    mask = MaskSpec(left=31, right=0, bottom_right=False)

    def reference(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        sinks_H = sinks.detach().clone().requires_grad_()
        longest = max(LENGTHS)
        ref, _ = varlen_reference(*leaves, cu, cu, longest, longest, scale=D**-0.5, mask=mask, sinks_H=sinks_H, compute_dtype=dtype)
        return (ref, *torch.autograd.grad(ref, (*leaves, sinks_H), grad_out.to(dtype)))

    _check("packed", (out, *grads), reference)


def test_the_providers_varlen_op_runs_as_head_groups(low_limit):
    pytest.importorskip("torch.nn.attention.varlen")  # defines the torch_attn ops
    if not hasattr(torch.ops.torch_attn, "_varlen_attn"):
        pytest.skip("torch without torch_attn::_varlen_attn")
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    cudnn_attention.reset_stats()
    with cudnn_attention.enabled(), cudnn_attention.strict():
        out = torch.ops.torch_attn._varlen_attn(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), True)[0]
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    stats = cudnn_attention.stats()
    assert stats["provider"]["varlen_forward"] == stats["provider"]["varlen_backward"] == 1, stats
    assert stats["cudnn_forward"] == stats["cudnn_backward"] == 8, stats  # 512 x 1 x 64 = 32,768 per group

    def reference(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        causal = MaskSpec(-1, 0, False)
        ref, _ = varlen_reference(*leaves, cu, cu, max(LENGTHS), max(LENGTHS), scale=64**-0.5, mask=causal, compute_dtype=dtype)
        return (ref, *torch.autograd.grad(ref, leaves, grad_out.to(dtype)))

    _check("varlen", (out, *grads), reference)
