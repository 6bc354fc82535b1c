"""``cudnn_attention.flash_attn_interface`` on cuDNN: bf16 calls in FlashAttention's layouts, served by cuDNN (strict
mode; counted in ``stats()``), within the project's tolerance rule against float64 (``tolerances.py``: at most twice
the error of the same math done by PyTorch in bf16, plus 1e-3 of the magnitude), gradients and the LSE included.

The references are ``reference64``'s, fed FlashAttention's semantics spelled out: ``causal`` as a right bound of 0
over whatever ``window_size[1]`` said, and the diagonal at the bottom right.
"""

import itertools

import pytest
import torch

import cudnn_attention
from cudnn_attention import flash_attn_interface as fai
from support.reference64 import reference_attention, reference_varlen_attention
from support.sync_debug import warm_and_run
from support.tolerances import assert_within_lowp_noise

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
BF16 = torch.bfloat16


def _fa_band(causal, window):
    return (window[0], 0 if causal else window[1])


def _finite(lse, like):
    return torch.where(torch.isfinite(like), lse, 0.0)


def _loss(out, lse, grad_out, grad_lse):
    # The LSE's rows of -inf (no key visible) take no part: they have no softmax to differentiate.
    return (out.float() * grad_out).sum() + (_finite(lse, lse).float() * grad_lse).sum()


def _served_by_cudnn(forward=1, backward=1):
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] == forward and stats["cudnn_backward"] == backward, stats
    assert not stats["fallback_forward"] and not stats["fallback_backward"], stats


def _check(names, got, ref, lowp):
    for name, a, b, c in zip(names, got, ref, lowp):
        if name == "lse":  # rows that see no key: -inf alike; compared where finite
            assert torch.equal(torch.isinf(a), torch.isinf(b)), "lse: rows of -inf differ"
            a, b, c = (_finite(t, b) for t in (a, b, c))
        assert_within_lowp_noise(name, a, b, c)


def _references(run_reference, leaves, grad_out, grad_lse):
    """``(out, lse, grads)`` of the reference in float64, then again in the inputs' own dtypes (the rule's noise term)."""
    results = []
    for to_float64 in (True, False):
        copies = [None if t is None else (t.detach().double() if to_float64 else t.detach().clone()).requires_grad_() for t in leaves]
        out, lse = run_reference(*copies, compute_dtype=torch.float64 if to_float64 else BF16)
        grads = torch.autograd.grad(_loss(out, lse, grad_out, grad_lse), [t for t in copies if t is not None])
        results.append((out, lse, grads))
    return results


# ----------------------------------------------------------------------------------------------
# Dense
# ----------------------------------------------------------------------------------------------

WINDOWS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "causal_over_right": (True, (37, 5)), "band": (False, (29, 13))}


@pytest.mark.parametrize("window_name, lengths, sinks", list(itertools.product(WINDOWS, ((203, 203), (67, 203), (203, 67)), (False, True))))
def test_dense_on_cudnn_matches_float64(window_name, lengths, sinks):
    causal, window = WINDOWS[window_name]
    S_q, S_kv = lengths
    torch.manual_seed(0)
    q = torch.randn(2, S_q, 8, 128, device=DEVICE, dtype=BF16, requires_grad=True)
    k = torch.randn(2, S_kv, 2, 128, device=DEVICE, dtype=BF16, requires_grad=True)
    v = torch.randn(2, S_kv, 2, 128, device=DEVICE, dtype=BF16, requires_grad=True)
    sink = torch.randn(8, device=DEVICE, dtype=torch.float32, requires_grad=True) if sinks else None
    grad_out = torch.randn(2, S_q, 8, 128, device=DEVICE)
    grad_lse = torch.randn(2, 8, S_q, device=DEVICE)
    # A band anchored at the bottom right with more queries than keys leaves whole rows without a key; cuDNN may decline
    # such a graph (the GPU fuzz counts "cuDNN rejected the forward/backward graph" fallbacks among these calls), so
    # they may be served either way, but must be right and said: cuDNN, or a fallback with its reason. A fallback's
    # output must still be laid out as q is (these cases found one that was not: strides of (B, H, S, D)).
    rows_without_keys = S_q > S_kv and (causal or window != (-1, -1))
    with cudnn_attention.strict(not rows_without_keys):
        out, lse, dropout_pattern = fai.flash_attn_func(q, k, v, 0.0, None, causal, window, return_attn_probs=True, learnable_sink=sink)
        leaves = [t for t in (q, k, v, sink) if t is not None]
        grads = torch.autograd.grad(_loss(out, lse, grad_out, grad_lse), leaves)
    if rows_without_keys:
        stats = cudnn_attention.stats()
        assert stats["cudnn_forward"] == 1 or stats["fallback_forward"], stats
        assert stats["cudnn_backward"] == 1 or stats["fallback_backward"], stats
    else:
        _served_by_cudnn()
    assert dropout_pattern is None and lse.dtype == torch.float32 and lse.shape == (2, 8, S_q)
    assert out.shape == q.shape and out.stride() == q.stride()  # FlashAttention's out is empty_like(q)
    band = _fa_band(causal, window)

    def run_reference(q, k, v, sink, compute_dtype):
        out, lse = reference_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            window_size=band,
            bottom_right=True,
            sinks=sink,
            return_lse=True,
            compute_dtype=compute_dtype,
        )
        return out.transpose(1, 2), lse

    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = _references(run_reference, [q, k, v, sink], grad_out, grad_lse)
    names = ["out", "lse", "dq", "dk", "dv", "dsink"][: 5 + sinks]
    _check(names, [out, lse, *grads], [ref_out, ref_lse, *ref_grads], [low_out, low_lse, *low_grads])


def test_qkvpacked_on_cudnn_matches_float64_and_deterministic_backward_repeats_bit_for_bit():
    torch.manual_seed(1)
    qkv = torch.randn(2, 150, 3, 4, 64, device=DEVICE, dtype=BF16, requires_grad=True)
    sink = torch.randn(4, device=DEVICE, dtype=BF16, requires_grad=True)
    grad_out = torch.randn(2, 150, 4, 64, device=DEVICE)
    runs = []
    with cudnn_attention.strict():
        for _ in range(2):
            out = fai.flash_attn_qkvpacked_func(qkv, 0.0, None, True, (64, -1), deterministic=True, learnable_sink=sink)
            runs.append(torch.autograd.grad((out.float() * grad_out).sum(), (qkv, sink)))
    _served_by_cudnn(forward=2, backward=2)
    assert not torch.are_deterministic_algorithms_enabled()
    for name, a, b in zip(("dqkv", "dsink"), *runs):
        assert torch.equal(a, b), f"{name} differs between two deterministic backward passes"
    results = {}
    for dtype in (torch.float64, BF16):
        leaf, sink_leaf = qkv.detach().to(dtype).requires_grad_(), sink.detach().to(dtype).requires_grad_()
        q, k, v = (t.transpose(1, 2) for t in leaf.unbind(2))
        ref = reference_attention(q, k, v, window_size=(64, 0), sinks=sink_leaf, compute_dtype=dtype).transpose(1, 2)
        results[dtype] = (ref, *torch.autograd.grad((ref.float() * grad_out).sum(), (leaf, sink_leaf)))
    _check(["out", "dqkv", "dsink"], [out, *runs[0]], results[torch.float64], results[BF16])


# ----------------------------------------------------------------------------------------------
# Packed documents
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (True, (48, 7)), (False, (-1, -1))])
def test_varlen_on_cudnn_matches_float64(causal, window):
    """Documents with fewer queries than keys (per-document bottom-right alignment), GQA, sinks, the (H, T) LSE."""
    torch.manual_seed(2)
    len_q, len_kv = [37, 128, 5, 64], [37, 150, 9, 64]
    cu_q = torch.tensor([0, *itertools.accumulate(len_q)], device=DEVICE, dtype=torch.int32)
    cu_kv = torch.tensor([0, *itertools.accumulate(len_kv)], device=DEVICE, dtype=torch.int32)
    q = torch.randn(sum(len_q), 8, 64, device=DEVICE, dtype=BF16, requires_grad=True)
    k = torch.randn(sum(len_kv), 2, 64, device=DEVICE, dtype=BF16, requires_grad=True)
    v = torch.randn(sum(len_kv), 2, 64, device=DEVICE, dtype=BF16, requires_grad=True)
    sink = torch.randn(8, device=DEVICE, dtype=torch.float32, requires_grad=True)
    grad_out, grad_lse = torch.randn(sum(len_q), 8, 64, device=DEVICE), torch.randn(8, sum(len_q), device=DEVICE)
    with cudnn_attention.strict():
        out, lse, _ = fai.flash_attn_varlen_func(
            q, k, v, cu_q, cu_kv, max(len_q), max(len_kv), 0.0, None, causal, window, return_attn_probs=True, learnable_sink=sink
        )
        grads = torch.autograd.grad(_loss(out, lse, grad_out, grad_lse), (q, k, v, sink))
    _served_by_cudnn()
    assert lse.shape == (8, sum(len_q))
    band = _fa_band(causal, window)

    def run_reference(q, k, v, sink, compute_dtype):
        out, lse = reference_varlen_attention(
            q, k, v, cu_q, cu_kv, window_size=band, bottom_right=True, sinks=sink, return_lse=True, compute_dtype=compute_dtype
        )
        return out, lse.t()

    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = _references(run_reference, [q, k, v, sink], grad_out, grad_lse)
    _check(["out", "lse", "dq", "dk", "dv", "dsink"], [out, lse, *grads], [ref_out, ref_lse, *ref_grads], [low_out, low_lse, *low_grads])


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("S_new, causal, window", [(1, True, (-1, -1)), (16, True, (64, 0)), (16, False, (-1, -1))])
def test_kvcache_on_cudnn_writes_the_cache_and_matches_float64_without_a_host_sync(S_new, causal, window):
    """A decode step (one new token) and a chunk of 16: the new keys land at ``cache_seqlens`` (a CUDA tensor), the
    queries attend bottom-right to the first ``cache_seqlens + S_new`` keys, cuDNN serves it, and the second call
    (graphs built) runs with every device-to-host synchronization raising."""
    torch.manual_seed(3)
    B, S_cache, H_kv, H, D = 3, 256, 2, 8, 64
    k_cache = torch.randn(B, S_cache, H_kv, D, device=DEVICE, dtype=BF16)
    v_cache = torch.randn(B, S_cache, H_kv, D, device=DEVICE, dtype=BF16)
    cache_seqlens = torch.tensor([100, 17, 200], device=DEVICE, dtype=torch.int32)
    q = torch.randn(B, S_new, H, D, device=DEVICE, dtype=BF16)
    k, v = (torch.randn(B, S_new, H_kv, D, device=DEVICE, dtype=BF16) for _ in range(2))
    sink = torch.randn(H, device=DEVICE, dtype=BF16)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(cache_seqlens.tolist()):
        expected_k[b, n : n + S_new], expected_v[b, n : n + S_new] = k[b], v[b]

    def step():
        return fai.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=cache_seqlens,
            causal=causal,
            window_size=window,
            return_softmax_lse=True,
            learnable_sink=sink,
        )

    with cudnn_attention.strict():
        out, lse = warm_and_run(step)  # writing the same keys twice leaves the same cache
    _served_by_cudnn(forward=2, backward=0)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    band = _fa_band(causal, window)
    refs = []
    for dtype in (torch.float64, BF16):
        ref_out, ref_lse = reference_attention(
            q.transpose(1, 2).to(dtype),
            expected_k.transpose(1, 2).to(dtype),
            expected_v.transpose(1, 2).to(dtype),
            window_size=band,
            bottom_right=True,
            sinks=sink.to(dtype),
            seqlens_kv=cache_seqlens + S_new,
            return_lse=True,
            compute_dtype=dtype,
        )
        refs.append((ref_out.transpose(1, 2), ref_lse))
    _check(["out", "lse"], [out, lse], *refs)
