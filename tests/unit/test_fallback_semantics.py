"""The exact PyTorch path against the tests' float64 reference (``support/reference64.py``): outputs and every gradient."""

import sys

import pytest
import torch

import cudnn_attention
from support.reference64 import reference_attention, reference_varlen_attention

# fp32 math against float64: a few ulps of fp32 relative to each tensor's magnitude.
RTOL = 2e-5


def assert_close_rel(actual, expected, what):
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max()
    assert err <= RTOL * scale, f"{what}: max abs error {err:.3g} exceeds {RTOL} x max |expected| {scale:.3g}"


DENSE_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "left_window": dict(causal=True, window_size=(3, -1)),
    "left_right_window": dict(window_size=(2, 1)),
    "right_only_window": dict(window_size=(-1, 2)),
    "bottom_right_decode": dict(causal=True, bottom_right=True, s_q=3),
    "bottom_right_window": dict(window_size=(2, 0), bottom_right=True, s_q=5),
    "gqa4_sinks": dict(causal=True, h_kv=1, sinks=True),
    "sinks_window": dict(causal=True, window_size=(4, 0), sinks=True),
    "padded": dict(causal=True, padded=True),
    "padded_sinks_bottom_right": dict(causal=True, bottom_right=True, padded=True, sinks=True, s_q=6),
    "q_longer_than_kv_bottom_right": dict(causal=True, bottom_right=True, s_q=9, s_kv=5),
    "value_dim_differs": dict(causal=True, d_v=6),
}


def _reference_options(case, scale):
    return dict(
        scale=scale,
        causal=case.get("causal", False),
        bottom_right=case.get("bottom_right", False),
        window_size=case.get("window_size", (-1, -1)),
    )


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_fallback_matches_naive(name):
    case = DENSE_CASES[name]
    torch.manual_seed(0)
    B, H, H_kv, D = 2, 4, case.get("h_kv", 2), 8
    S_q, S_kv, D_v = case.get("s_q", 7), case.get("s_kv", 7), case.get("d_v", D)
    q = torch.randn(B, H, S_q, D, requires_grad=True)
    k = torch.randn(B, H_kv, S_kv, D, requires_grad=True)
    v = torch.randn(B, H_kv, S_kv, D_v, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True) if case.get("sinks") else None
    len_q = torch.tensor([S_q, max(1, S_q - 3)]) if case.get("padded") else None
    len_kv = torch.tensor([S_kv, max(1, S_kv - 2)]) if case.get("padded") else None
    grad_out = torch.randn(B, H, S_q, D_v)

    out = cudnn_attention.attention(
        q,
        k,
        v,
        scale=0.3,
        causal=case.get("causal", False),
        bottom_right=case.get("bottom_right", False),
        window_size=case.get("window_size", (-1, -1)),
        sinks=sinks,
        seqlens_q=len_q,
        seqlens_kv=len_kv,
    )
    grads = torch.autograd.grad(out, [t for t in (q, k, v, sinks) if t is not None], grad_out)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks) if t is not None]
    expected = reference_attention(
        *leaves[:3], sinks=leaves[3] if sinks is not None else None, seqlens_q=len_q, seqlens_kv=len_kv, **_reference_options(case, 0.3)
    )
    expected_grads = torch.autograd.grad(expected, leaves, grad_out.double())

    assert out.dtype == q.dtype and out.shape == (B, H, S_q, D_v)
    assert_close_rel(out, expected, "out")
    for name_, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected_grads):
        assert_close_rel(got, want, name_)
    if len_q is not None:
        assert out[1, :, int(len_q[1]) :].abs().max() == 0, "rows past seqlens_q must be exactly zero"
        assert grads[0][1, :, int(len_q[1]) :].abs().max() == 0, "padded query rows must get zero gradient"


VARLEN_CASES = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(2, 0)),
    "left_right_window": dict(window_size=(1, 2)),
    "sinks_gqa": dict(causal=True, sinks=True, h_kv=1),
    "bottom_right_decode": dict(causal=True, bottom_right=True, decode=True),
    "capacity_tail": dict(causal=True, tail=3),
    # (T, H, D) views of (H, T, D) memory, as transformers' gpt-oss passes q and k: copied token-major, gradients mapped back.
    "head_major_sinks_window": dict(causal=True, sinks=True, window_size=(2, 0), head_major=True),
}


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_fallback_matches_naive(name):
    case = VARLEN_CASES[name]
    torch.manual_seed(1)
    lengths_kv = [5, 1, 3, 1, 6]  # length-1 documents included
    lengths_q = [min(2, n) for n in lengths_kv] if case.get("decode") else lengths_kv
    tail = case.get("tail", 0)
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_kv = torch.tensor([0] + torch.tensor(lengths_kv).cumsum(0).tolist(), dtype=torch.int32)
    T_q, T_kv = int(cu_q[-1]) + tail, int(cu_kv[-1]) + tail
    H, H_kv, D = 4, case.get("h_kv", 2), 8
    if case.get("head_major"):
        q, k = torch.randn(H, T_q, D).transpose(0, 1).requires_grad_(), torch.randn(H_kv, T_kv, D).transpose(0, 1).requires_grad_()
    else:
        q, k = torch.randn(T_q, H, D, requires_grad=True), torch.randn(T_kv, H_kv, D, requires_grad=True)
    v = torch.randn(T_kv, H_kv, D, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True) if case.get("sinks") else None
    grad_out = torch.randn(T_q, H, D)

    out = cudnn_attention.varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_kv,
        max(lengths_q),
        max(lengths_kv),
        scale=0.4,
        causal=case.get("causal", False),
        bottom_right=case.get("bottom_right", False),
        window_size=case.get("window_size", (-1, -1)),
        sinks=sinks,
        validate=True,
    )
    grads = torch.autograd.grad(out, [t for t in (q, k, v, sinks) if t is not None], grad_out)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks) if t is not None]
    sink_leaf = leaves[3] if sinks is not None else None
    expected = reference_varlen_attention(*leaves[:3], cu_q, cu_kv, sinks=sink_leaf, **_reference_options(case, 0.4))
    expected_grads = torch.autograd.grad(expected, leaves, grad_out.double())
    assert_close_rel(out, expected, "out")
    for name_, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected_grads):
        assert_close_rel(got, want, name_)
    if tail:
        assert out[-tail:].abs().max() == 0 and grads[1][-tail:].abs().max() == 0, "capacity tail must be zero, with zero gradient"


def test_lse_includes_sink_and_is_minus_inf_on_padding():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    sinks = torch.randn(2)
    _, lse = cudnn_attention.attention(q, k, v, causal=True, sinks=sinks, seqlens_q=torch.tensor([4, 2]), return_lse=True)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 8**0.5
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    expected = torch.logsumexp(torch.cat([scores, sinks.view(1, 2, 1, 1).expand(2, 2, 4, 1)], -1), -1)
    torch.testing.assert_close(lse[0], expected[0])
    torch.testing.assert_close(lse[1, :, :2], expected[1, :, :2])
    assert torch.isneginf(lse[1, :, 2:]).all()


def test_fully_masked_rows_are_zero_without_nan_gradients():
    # Bottom-right causal with more queries than keys: the first rows see no key at all.
    torch.manual_seed(3)
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    k = torch.randn(1, 2, 3, 8, requires_grad=True)
    v = torch.randn(1, 2, 3, 8, requires_grad=True)
    out = cudnn_attention.attention(q, k, v, causal=True, bottom_right=True)
    out.sum().backward()
    assert out[:, :, :3].abs().max() == 0
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert q.grad[:, :, :3].abs().max() == 0


def test_transposed_views_keep_layout():
    torch.manual_seed(4)
    q_BSHD = torch.randn(2, 5, 4, 8)
    out = cudnn_attention.attention(q_BSHD.transpose(1, 2), q_BSHD.transpose(1, 2), q_BSHD.transpose(1, 2), causal=True)
    assert out.shape == (2, 4, 5, 8)
    expected = reference_attention(*(q_BSHD.transpose(1, 2),) * 3, scale=8**-0.5, causal=True)
    assert_close_rel(out, expected, "out")


@pytest.mark.parametrize("entry", ["attention", "varlen_attention"])
def test_fallback_warning_points_at_the_callers_line(entry):
    # The warning names the line that called the library, so a user can find which call fell back.
    q = torch.randn(8, 2, 16) if entry == "varlen_attention" else torch.randn(1, 2, 8, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    args = (q, q, q, cu, cu, 8, 8) if entry == "varlen_attention" else (q, q, q)
    with pytest.warns(cudnn_attention.CudnnAttentionFallbackWarning) as record:
        line = sys._getframe().f_lineno + 1
        getattr(cudnn_attention, entry)(*args, causal=True)
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line)]


def test_a_dense_fallback_lays_out_its_output_as_q_is():
    # The cuDNN path's output adopts q's layout; the exact path's must too: FlashAttention's interface and transformers
    # read a (B, S, H, D) leaf's result as (B, S, H, D). A GPU run found a fallback's strides were (B, H, S, D)'s.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 7, h, 8).transpose(1, 2) for h in (4, 2, 2))
    out = cudnn_attention.attention(q, k, v, causal=True)
    assert out.transpose(1, 2).is_contiguous(), out.stride()
    assert_close_rel(out, reference_attention(q, k, v, causal=True), "out")
