"""A differentiable LSE on CPU: the fallback's gradients of losses that use ``return_lse``'s LSE, against float64 autograd.

``evaluate_call`` (``tests/support/reference64.py``) runs the call, the backward of a loss over the output and/or the LSE (with
random weights on every row, ``-inf`` rows included) and the same loss through the independent float64 reference,
and applies FlashAttention's rule (here, float32 against float64). The cuDNN path's share is checked on CPU in
``tests/unit/test_lse_grad_emulated.py``; on a GPU in ``tests/gpu/test_gpu_lse_grad.py``.
"""

import itertools

import pytest
import torch

import cudnn_attention
from support.reference64 import evaluate_call

# name -> (options, dense shape overrides); small enough for float64 autograd in a few ms.
DENSE_CASES = {
    "plain": (dict(), {}),
    "causal_gqa": (dict(causal=True), dict(h_kv=1)),
    "window": (dict(window_size=(2, 1)), {}),
    # Queries 0..3 see no key (bottom-right causal, more queries than keys): valid rows with lse = -inf.
    "rows_without_keys": (dict(causal=True, bottom_right=True), dict(s_q=9, s_kv=5)),
    "padded": (dict(causal=True, seqlens_q=[7, 4], seqlens_kv=[7, 5]), {}),
    "padded_no_key_sequence": (dict(seqlens_q=[7, 3], seqlens_kv=[6, 0]), {}),
    "sinks": (dict(causal=True, sinks=True), dict(h_kv=1)),
    "sinks_window_padded": (dict(causal=True, window_size=(2, 0), sinks=True, seqlens_q=[7, 5], seqlens_kv=[7, 6]), {}),
    "sinks_rows_without_keys": (dict(causal=True, bottom_right=True, sinks=True), dict(s_q=9, s_kv=5)),
}
PACKED_CASES = {
    "tail": (dict(causal=True), dict(lengths=[5, 1, 7], tail=3)),
    "empty_document_tail": (dict(causal=True, window_size=(2, 0)), dict(lengths=[4, 0, 6], tail=2)),
    "sinks_tail": (dict(causal=True, sinks=True), dict(lengths=[5, 1, 7], tail=3)),
    "sinks_window_queries_without_keys": (
        dict(causal=True, window_size=(3, 0), sinks=True),
        dict(lengths=[4, 6], kv_lengths=[4, 0], tail=2),
    ),
}
LOSSES = ("out+lse", "lse")


def _dense_args(options, shape, seed=0):
    torch.manual_seed(seed)
    B, H, H_kv, D = 2, 4, shape.get("h_kv", 2), 8
    S_q, S_kv = shape.get("s_q", 7), shape.get("s_kv", 7)
    q = torch.randn(B, H, S_q, D, requires_grad=True)
    k = torch.randn(B, H_kv, S_kv, D, requires_grad=True)
    v = torch.randn(B, H_kv, S_kv, D, requires_grad=True)
    kwargs = dict(options, return_lse=True)
    if options.get("sinks"):
        kwargs["sinks"] = torch.randn(H, requires_grad=True)
    for name in ("seqlens_q", "seqlens_kv"):
        if name in options:
            kwargs[name] = torch.tensor(options[name])
    return (q, k, v), kwargs


def _packed_args(options, shape, seed=0):
    torch.manual_seed(seed)
    H, H_kv, D = 4, 2, 8
    lengths, tail = shape["lengths"], shape["tail"]
    kv_lengths = shape.get("kv_lengths", lengths)
    cu_q = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    cu_kv = torch.tensor([0, *itertools.accumulate(kv_lengths)], dtype=torch.int32)
    q = torch.randn(sum(lengths) + tail, H, D, requires_grad=True)
    k = torch.randn(sum(kv_lengths) + tail, H_kv, D, requires_grad=True)
    v = torch.randn(sum(kv_lengths) + tail, H_kv, D, requires_grad=True)
    kwargs = dict(options, return_lse=True)
    if options.get("sinks"):
        kwargs["sinks"] = torch.randn(H, requires_grad=True)
    return (q, k, v, cu_q, cu_kv, max(lengths), max(kv_lengths)), kwargs


def _assert_ok(result):
    assert result["ok"], [c for c in result["checks"] if not c["ok"]]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name", DENSE_CASES)
def test_dense_fallback_lse_gradients_match_float64(name, loss):
    args, kwargs = _dense_args(*DENSE_CASES[name])
    result = evaluate_call("dense", args, kwargs, loss=loss)
    _assert_ok(result)
    assert cudnn_attention.stats()["fallback_backward"], "the fallback served the backward, and counted it"


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name", PACKED_CASES)
def test_packed_fallback_lse_gradients_match_float64(name, loss):
    args, kwargs = _packed_args(*PACKED_CASES[name])
    _assert_ok(evaluate_call("varlen", args, kwargs, loss=loss))


def test_lse_gradient_is_not_a_zero_that_passes():
    # The comparisons above must be able to fail: the LSE's share of dQ is of the same order as the output's.
    args, kwargs = _dense_args(*DENSE_CASES["sinks"])
    with_lse = evaluate_call("dense", args, kwargs, loss="lse")
    q, k, v = args
    dq_lse, dsinks_lse = torch.autograd.grad(cudnn_attention.attention(q, k, v, **kwargs)[1].exp().sum(), (q, kwargs["sinks"]))
    assert with_lse["ok"] and dq_lse.abs().max() > 0.1 and dsinks_lse.abs().min() > 0


def test_rows_with_lse_minus_inf_pass_on_no_gradient_and_no_nan():
    # Padded rows, a sequence with no key, valid rows that see no key: lse = -inf, and whatever gradient reaches
    # those rows (here a NaN-free random one, which a sum over the LSE would also give) must stop there.
    args, kwargs = _dense_args(dict(causal=True, bottom_right=True, seqlens_q=[9, 2], seqlens_kv=[5, 0]), dict(s_q=9, s_kv=5))
    q, k, v = args
    _, lse = cudnn_attention.attention(q, k, v, **kwargs)
    dead = lse == float("-inf")
    assert dead[0, :, :4].all() and dead[1].all() and not dead[0, :, 4:].any()
    grad_lse = torch.randn_like(lse)
    dq, dk, dv = torch.autograd.grad(lse, (q, k, v), grad_lse, allow_unused=True)
    assert torch.isfinite(dq).all() and dq[0, :, :4].abs().max() == 0 and dq[1].abs().max() == 0
    assert torch.isfinite(dk).all() and dk[1].abs().max() == 0 and dq[0, :, 4:].abs().max() > 0
    assert dv is None or dv.abs().max() == 0  # the LSE does not depend on V


def test_torchtitan_sinks_over_a_sinkless_call_equal_the_sink_call():
    """gpt-oss sinks as torchtitan trains them, ``out * sigmoid(lse - sink)`` over a sink-less kernel, are the sink
    call itself; gradients included, which needs the LSE's gradient (without it the sum below runs and is silently
    wrong: this test failed before the LSE was differentiable, dq off by as much as the sink's own share)."""
    torch.manual_seed(0)
    B, H, S, D = 2, 4, 6, 8
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    sinks = torch.randn(H, requires_grad=True)
    lengths = torch.tensor([6, 4])
    grad_out = torch.randn(B, H, S, D)

    want = cudnn_attention.attention(q, k, v, causal=True, sinks=sinks, seqlens_q=lengths, seqlens_kv=lengths)
    want_grads = torch.autograd.grad((want * grad_out).sum(), (q, k, v, sinks))
    out, lse = cudnn_attention.attention(q, k, v, causal=True, seqlens_q=lengths, seqlens_kv=lengths, return_lse=True)
    got = out * torch.sigmoid(lse - sinks.view(1, H, 1)).unsqueeze(-1)  # lse = -inf (padding): sigmoid 0, gradient 0
    got_grads = torch.autograd.grad((got * grad_out).sum(), (q, k, v, sinks))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
