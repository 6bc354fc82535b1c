"""float64 in, float64 math out: the exact path computes float64 inputs in float64, so torch.autograd.gradcheck
holds through the public API (as it does for torch's own math SDPA), and float64 outputs match float64 references
to float64 rounding rather than float32's."""

import pytest
import torch
import torch.nn.functional as F

import cudnn_attention
from cudnn_attention.masking import make_mask_spec
from cudnn_attention.reference import dense_reference
from support.reference64 import reference_attention, reference_varlen_attention

# float64 math against a float64 reference: summation order only. float32 math lands near 1e-7 of the magnitude,
# five orders of magnitude above this, so a float32 computation cannot pass.
RTOL64 = 1e-12

DENSE_CASES = {
    "plain": dict(),
    "gqa": dict(h_kv=1),
    "padded": dict(padded=True),
    "padded_causal": dict(padded=True, causal=True),
    "sinks": dict(sinks=True),
    "sinks_window_padded": dict(sinks=True, window_size=(2, 0), padded=True),
    "window_left_right": dict(window_size=(2, 1)),
    "causal": dict(causal=True),
    "causal_bottom_right": dict(causal=True, bottom_right=True, s_q=3),
    "window_bottom_right": dict(window_size=(1, 0), bottom_right=True, s_q=3),
}

VARLEN_CASES = {
    "packed": dict(),
    "packed_causal": dict(causal=True),
    "packed_sinks": dict(causal=True, sinks=True),
    "packed_window": dict(window_size=(1, 1)),
    "packed_bottom_right_decode": dict(causal=True, bottom_right=True, decode=True),
}


def _dense_inputs(case, *, seed: int):
    torch.manual_seed(seed)
    B, H, H_kv, D = 2, 2, case.get("h_kv", 2), 3
    S_q, S_kv = case.get("s_q", 4), 4
    q = torch.randn(B, H, S_q, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, H_kv, S_kv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, H_kv, S_kv, D, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True) if case.get("sinks") else None
    lengths = dict(seqlens_q=torch.tensor([S_q, S_q - 1]), seqlens_kv=torch.tensor([S_kv, S_kv - 2])) if case.get("padded") else {}
    options = dict(
        causal=case.get("causal", False), bottom_right=case.get("bottom_right", False), window_size=case.get("window_size", (-1, -1))
    )
    return q, k, v, sinks, lengths, options


def _varlen_inputs(case, *, seed: int):
    torch.manual_seed(seed)
    lengths_kv = [3, 1, 2]  # more than one document, a length-1 one among them
    lengths_q = [min(2, n) for n in lengths_kv] if case.get("decode") else lengths_kv
    tail = 2  # tokens past cu_seqlens[-1]: a capacity tail, zero output and zero gradient
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_kv = torch.tensor([0] + torch.tensor(lengths_kv).cumsum(0).tolist(), dtype=torch.int32)
    H, H_kv, D = 2, 1, 3
    q = torch.randn(int(cu_q[-1]) + tail, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(int(cu_kv[-1]) + tail, H_kv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(int(cu_kv[-1]) + tail, H_kv, D, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True) if case.get("sinks") else None
    options = dict(
        causal=case.get("causal", False), bottom_right=case.get("bottom_right", False), window_size=case.get("window_size", (-1, -1))
    )
    return q, k, v, sinks, (cu_q, cu_kv, max(lengths_q), max(lengths_kv)), options, tail


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_gradcheck_dense(name):
    q, k, v, sinks, lengths, options = _dense_inputs(DENSE_CASES[name], seed=0)
    inputs = tuple(t for t in (q, k, v, sinks) if t is not None)

    def fn(q, k, v, *rest):
        return cudnn_attention.attention(q, k, v, scale=0.7, sinks=rest[0] if rest else None, **lengths, **options)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_gradcheck_varlen(name):
    q, k, v, sinks, packing, options, tail = _varlen_inputs(VARLEN_CASES[name], seed=1)
    inputs = tuple(t for t in (q, k, v, sinks) if t is not None)

    def fn(q, k, v, *rest):
        return cudnn_attention.varlen_attention(q, k, v, *packing, scale=0.7, sinks=rest[0] if rest else None, **options)

    assert torch.autograd.gradcheck(fn, inputs)
    out = fn(*inputs)
    out.sum().backward()
    assert out[-tail:].abs().max() == 0 and q.grad[-tail:].abs().max() == 0, "the capacity tail must be zero, with zero gradient"


def _assert_close64(actual, expected, what):
    assert actual.dtype == torch.float64, f"{what}: {actual.dtype}, expected float64"
    err = (actual - expected).abs().max()
    scale = expected.abs().max().clamp_min(1e-300)
    assert err <= RTOL64 * scale, f"{what}: max abs error {err:.3g} > {RTOL64} x max |expected| {scale:.3g} (float32 math lands near 1e-7)"


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_float64_matches_float64_naive(name):
    case = DENSE_CASES[name]
    q, k, v, sinks, lengths, options = _dense_inputs(case, seed=2)
    out = cudnn_attention.attention(q, k, v, scale=0.7, sinks=sinks, **lengths, **options)
    expected = reference_attention(q, k, v, scale=0.7, sinks=sinks, **lengths, **options)
    _assert_close64(out, expected, "out")
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    grad_out = torch.randn_like(out)
    grads, expected_grads = torch.autograd.grad(out, leaves, grad_out), torch.autograd.grad(expected, leaves, grad_out)
    for what, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected_grads):
        _assert_close64(got, want, what)


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_float64_matches_float64_naive(name):
    q, k, v, sinks, packing, options, _ = _varlen_inputs(VARLEN_CASES[name], seed=3)
    out = cudnn_attention.varlen_attention(q, k, v, *packing, scale=0.7, sinks=sinks, **options)
    expected = reference_varlen_attention(q, k, v, packing[0], packing[1], scale=0.7, sinks=sinks, **options)
    _assert_close64(out, expected, "out")


def test_float64_matches_torch_math_sdpa():
    # torch's own math SDPA computes float64 in float64: the same function to float64 rounding.
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 3, 6, 5, dtype=torch.float64) for _ in range(3))
    out = cudnn_attention.attention(q, k, v, causal=True)
    _assert_close64(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), "out")


def test_float64_lse_is_float64_and_exact():
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, dtype=torch.float32)  # any float dtype: taken into the float64 math
    out, lse = cudnn_attention.attention(q, k, v, sinks=sinks, return_lse=True)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 2.0
    expected = torch.logsumexp(torch.cat([scores, sinks.double().view(1, 2, 1, 1).expand(2, 2, 5, 1)], -1), -1)
    _assert_close64(lse, expected, "lse")
    T = 7
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    qp, kp, vp = (torch.randn(T, 2, 4, dtype=torch.float64) for _ in range(3))
    _, lse_packed = cudnn_attention.varlen_attention(qp, kp, vp, cu, cu, 3, 3, return_lse=True)
    assert lse_packed.dtype == torch.float64
    assert torch.isneginf(lse_packed[5:]).all(), "the capacity tail's lse is -inf"
    first = torch.logsumexp(torch.einsum("qhd,khd->hqk", qp[:3], kp[:3]) / 2.0, -1).t()
    _assert_close64(lse_packed[:3], first, "packed lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_other_dtypes_keep_float32_math_and_lse(dtype):
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=dtype) for _ in range(3))
    out, lse = cudnn_attention.attention(q, k, v, sinks=torch.randn(2, dtype=torch.float64), return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32


def test_compute_dtype_still_chooses_the_math():
    # The GPU tests' low-precision baseline: PyTorch's own math in the inputs' dtype, away from the float32 default.
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = make_mask_spec(causal=True, bottom_right=False, window_size=(-1, -1))
    default, lse = dense_reference(q, k, v, scale=0.25, mask=mask)
    low, _ = dense_reference(q, k, v, scale=0.25, mask=mask, compute_dtype=torch.bfloat16)
    assert lse.dtype == torch.float32 and not torch.equal(default, low)
    # And float64 inputs computed in float32 on request land at float32's error, far from float64's.
    q64, k64, v64 = (t.double() for t in (q, k, v))
    exact, _ = dense_reference(q64, k64, v64, scale=0.25, mask=mask)
    in_fp32, lse32 = dense_reference(q64, k64, v64, scale=0.25, mask=mask, compute_dtype=torch.float32)
    assert lse32.dtype == torch.float32 and in_fp32.dtype == torch.float64
    assert (in_fp32 - exact).abs().max() > 1e3 * RTOL64 * exact.abs().max()
