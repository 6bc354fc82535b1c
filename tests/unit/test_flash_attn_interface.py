"""``cudnn_attention.flash_attn_interface`` on CPU: FlashAttention's semantics end to end through the exact path.

Every result is compared with a float64 reference written here from FlashAttention's documentation alone: an
explicit boolean mask (query ``i`` sees key ``j`` iff ``i + S_kv - S_q - left <= j <= i + S_kv - S_q + right``,
``causal`` forcing ``right = 0``, -1 unbounded) and a plain softmax with the sink as one more logit; gradients
come from autograd through it. ``test_gpu_flash_attn_interface.py`` runs the same calls on cuDNN.
"""

import inspect
import math
import random

import pytest
import torch

import cudnn_attention
from cudnn_attention import flash_attn_interface as fai

F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# The reference
# ----------------------------------------------------------------------------------------------


def fa_mask(S_q: int, S_kv: int, kv_length: int, left: int, right: int) -> torch.Tensor:
    """(S_q, S_kv) bool: FlashAttention's band, bottom-right aligned on the first ``kv_length`` keys."""
    mask = torch.zeros(S_q, S_kv, dtype=torch.bool)
    for i in range(S_q):
        row = i + kv_length - S_q
        for j in range(kv_length):
            mask[i, j] = (left < 0 or j >= row - left) and (right < 0 or j <= row + right)
    return mask


def reference(q, k, v, *, scale=None, causal=False, window=(-1, -1), sink=None, kv_lengths=None):
    """``(out (B, S_q, H, D_v), lse (B, H, S_q))`` in float64 over FlashAttention's (B, S, H, D) tensors."""
    B, S_q, H, D = q.shape
    S_kv, H_kv = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    left, right = window[0], 0 if causal else window[1]
    lengths = [S_kv] * B if kv_lengths is None else kv_lengths
    mask = torch.stack([fa_mask(S_q, S_kv, n, left, right) for n in lengths]).view(B, 1, S_q, S_kv)
    q_h = q.to(F64).transpose(1, 2)
    k_h, v_h = (t.to(F64).repeat_interleave(H // H_kv, dim=2).transpose(1, 2) for t in (k, v))  # query head h reads KV head h // G
    scores = (scale * q_h @ k_h.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.to(F64).view(1, H, 1, 1).expand(B, H, S_q, 1)], dim=-1)
    top = scores.detach().amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    empty = total == 0  # a row that sees nothing: zero output, lse = -inf
    probs = weights / torch.where(empty, 1.0, total)
    out = probs[..., :S_kv] @ v_h
    lse = torch.where(empty, float("-inf"), torch.log(torch.where(empty, 1.0, total)) + top).squeeze(-1)
    return out.transpose(1, 2), lse


def varlen_reference(q, k, v, cu_q, cu_kv, **options):
    """``(out (T_q, H, D_v), lse (H, T_q))``: :func:`reference` per document."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_kv[b], cu_kv[b + 1])
        out, lse = reference(q[None, qs], k[None, ks], v[None, ks], **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def finite_where(lse, like):
    # Rows with lse = -inf take no part in a loss (they have no softmax to differentiate).
    return torch.where(torch.isfinite(like), lse, 0.0)


def assert_close(got, want, name):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


def leaves(*shapes, seed):
    torch.manual_seed(seed)
    return [torch.randn(*shape, dtype=F64, requires_grad=True) for shape in shapes]


def no_kernel_ran():
    stats = cudnn_attention.stats()
    return stats["cudnn_forward"] == 0 and not stats["fallback_forward"]


# ----------------------------------------------------------------------------------------------
# Signatures
# ----------------------------------------------------------------------------------------------

_VARLEN = "cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k"
_COMMON = "dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 alibi_slopes=None deterministic=False"
# FlashAttention 2's parameters in order, with their defaults (flash_attn/flash_attn_interface.py, 2.8.4).
FA2_SIGNATURES = {
    "flash_attn_func": f"q k v {_COMMON} return_attn_probs=False",
    "flash_attn_qkvpacked_func": f"qkv {_COMMON} return_attn_probs=False",
    "flash_attn_kvpacked_func": f"q kv {_COMMON} return_attn_probs=False",
    "flash_attn_varlen_func": f"q k v {_VARLEN} {_COMMON} return_attn_probs=False block_table=None",
    "flash_attn_varlen_qkvpacked_func": f"qkv cu_seqlens max_seqlen {_COMMON} return_attn_probs=False",
    "flash_attn_varlen_kvpacked_func": f"q kv {_VARLEN} {_COMMON} return_attn_probs=False",
    "flash_attn_with_kvcache": "q k_cache v_cache k=None v=None rotary_cos=None rotary_sin=None cache_seqlens=None cache_batch_idx=None "
    "cache_leftpad=None block_table=None softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 rotary_interleaved=True "
    "alibi_slopes=None num_splits=0 return_softmax_lse=False",
}


@pytest.mark.parametrize("name", sorted(FA2_SIGNATURES))
def test_positional_parameters_are_flash_attention_2s(name):
    """Positional calls written for FlashAttention 2 bind the same way; ``learnable_sink`` is keyword-only."""
    parameters = inspect.signature(getattr(fai, name)).parameters.values()
    positional = [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert " ".join(positional) == FA2_SIGNATURES[name]
    assert [p.name for p in parameters if p.kind is p.KEYWORD_ONLY] == ["learnable_sink"]


def test_exported_from_the_package():
    assert "flash_attn_interface" in cudnn_attention.__all__ and cudnn_attention.flash_attn_interface is fai
    assert sorted(fai.__all__) == sorted(FA2_SIGNATURES)


# ----------------------------------------------------------------------------------------------
# Dense
# ----------------------------------------------------------------------------------------------


def _draw_dense(seed):
    rng = random.Random(seed)
    B, S_q, S_kv = rng.randint(1, 3), rng.randint(1, 11), rng.randint(1, 11)
    H_kv, G, D = rng.choice((1, 2)), rng.choice((1, 2, 3)), rng.choice((4, 8))
    D_v = rng.choice((D, 6))
    window = (rng.choice((-1, rng.randint(0, S_kv))), rng.choice((-1, 0, rng.randint(0, S_kv))))
    options = dict(scale=rng.choice((None, rng.uniform(0.1, 1.0))), causal=rng.random() < 0.5, window=window)
    return (B, S_q, S_kv, H_kv, G, D, D_v), options, rng.random() < 0.5, rng.random() < 0.5


@pytest.mark.parametrize("seed", range(24))
def test_dense_matches_float64_reference(seed):
    """Output, LSE and the gradients of q, k, v and the sinks, over random shapes (S_q above and below S_kv),
    GQA, windows, ``causal`` over any right bound, scales, sinks; arguments passed positionally, as FA2's order."""
    (B, S_q, S_kv, H_kv, G, D, D_v), options, with_sink, deterministic = _draw_dense(seed)
    H = H_kv * G
    q, k, v, sink = leaves((B, S_q, H, D), (B, S_kv, H_kv, D), (B, S_kv, H_kv, D_v), (H,), seed=seed)
    sink = sink if with_sink else None
    out, lse, dropout_pattern = fai.flash_attn_func(
        q, k, v, 0.0, options["scale"], options["causal"], options["window"], 0.0, None, deterministic, True, learnable_sink=sink
    )
    want_out, want_lse = reference(q, k, v, sink=sink, **options)
    assert dropout_pattern is None and out.shape == (B, S_q, H, D_v) and lse.shape == (B, H, S_q)
    assert_close(out, want_out, "out")
    assert_close(lse, want_lse, "lse")
    torch.manual_seed(seed + 1000)
    grad_out, grad_lse = torch.randn_like(want_out), torch.randn_like(want_lse)
    inputs = [t for t in (q, k, v, sink) if t is not None]
    got = torch.autograd.grad((out * grad_out).sum() + (finite_where(lse, want_lse) * grad_lse).sum(), inputs)
    want = torch.autograd.grad((want_out * grad_out).sum() + (finite_where(want_lse, want_lse) * grad_lse).sum(), inputs)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert_close(a, b, name)


@pytest.mark.parametrize(
    "S_q, S_kv, visible",
    [
        (2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]),
    ],
)
def test_causal_masks_are_flash_attentions_bottom_right_ones(S_q, S_kv, visible):
    """FlashAttention's docstring's two causal masks, read off the output: with q = 0 every visible key weighs
    alike, and v = identity puts key j's weight in column j; a row that sees no key is zero."""
    q = torch.zeros(1, S_q, 1, S_kv, dtype=F64)
    v = torch.eye(S_kv, dtype=F64).view(1, S_kv, 1, S_kv)
    out = fai.flash_attn_func(q, torch.randn(1, S_kv, 1, S_kv, dtype=F64), v, causal=True)
    assert (out[0, :, 0] > 0).int().tolist() == visible
    assert out[0, :, 0].sum(-1).tolist() == [1.0 if any(row) else 0.0 for row in visible]


def test_causal_overrides_the_right_bound():
    """``causal=True`` sets the right bound to 0 whatever ``window_size[1]`` says (the core refuses the mix)."""
    q, k, v = leaves((2, 7, 2, 8), (2, 9, 2, 8), (2, 9, 2, 8), seed=1)
    for window in ((3, 4), (3, -1), (-1, 5)):
        got = fai.flash_attn_func(q, k, v, causal=True, window_size=window)
        assert torch.equal(got, fai.flash_attn_func(q, k, v, causal=True, window_size=(window[0], 0)))
        assert_close(got, reference(q, k, v, window=(window[0], 0))[0], f"causal with {window}")
    assert not torch.allclose(
        fai.flash_attn_func(q, k, v, window_size=(3, 4)), fai.flash_attn_func(q, k, v, causal=True, window_size=(3, 4))
    )


def test_window_bounds_of_none_are_unbounded():
    """FlashAttention 4 writes an unbounded side as None; -1 in FlashAttention 2."""
    q, k, v = leaves((1, 6, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8), seed=2)
    assert torch.equal(fai.flash_attn_func(q, k, v, window_size=(None, None)), fai.flash_attn_func(q, k, v))
    assert torch.equal(fai.flash_attn_func(q, k, v, window_size=(2, None)), fai.flash_attn_func(q, k, v, window_size=(2, -1)))


def test_default_softmax_scale_is_one_over_sqrt_head_dim():
    q, k, v = leaves((1, 5, 2, 16), (1, 5, 2, 16), (1, 5, 2, 16), seed=3)
    default = fai.flash_attn_func(q, k, v)
    assert_close(default, fai.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(16)), "softmax_scale=None")
    assert_close(default, reference(q, k, v, scale=0.25)[0], "reference at 1 / sqrt(16)")
    assert not torch.allclose(default, fai.flash_attn_func(q, k, v, softmax_scale=1.0))


# ----------------------------------------------------------------------------------------------
# Packed documents
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_varlen_matches_float64_reference(seed):
    """Per-document bottom-right alignment (documents with more queries than keys and the reverse), windows,
    ``causal``, GQA and sinks; the LSE is FlashAttention's (H, T_q)."""
    rng = random.Random(seed)
    documents = rng.randint(1, 4)
    len_q = [rng.randint(1, 7) for _ in range(documents)]
    len_kv = [rng.randint(1, 7) for _ in range(documents)]
    cu_q, cu_kv = ([0] + [sum(n[: b + 1]) for b in range(documents)] for n in (len_q, len_kv))
    H_kv, G, D = rng.choice((1, 2)), rng.choice((1, 3)), 8
    H = H_kv * G
    q, k, v, sink = leaves((cu_q[-1], H, D), (cu_kv[-1], H_kv, D), (cu_kv[-1], H_kv, D), (H,), seed=seed)
    sink = sink if rng.random() < 0.5 else None
    options = dict(causal=rng.random() < 0.5, window=(rng.choice((-1, rng.randint(0, 6))), rng.choice((-1, 0, rng.randint(0, 6)))))
    out, lse, _ = fai.flash_attn_varlen_func(
        q,
        k,
        v,
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_kv, dtype=torch.int32),
        max(len_q),
        max(len_kv),
        causal=options["causal"],
        window_size=options["window"],
        return_attn_probs=True,
        learnable_sink=sink,
    )
    want_out, want_lse = varlen_reference(q, k, v, cu_q, cu_kv, sink=sink, **options)
    assert lse.shape == (H, cu_q[-1])
    assert_close(out, want_out, "out")
    assert_close(lse, want_lse, "lse")
    grad_out, grad_lse = torch.randn_like(want_out), torch.randn_like(want_lse)
    inputs = [t for t in (q, k, v, sink) if t is not None]
    got = torch.autograd.grad((out * grad_out).sum() + (finite_where(lse, want_lse) * grad_lse).sum(), inputs)
    want = torch.autograd.grad((want_out * grad_out).sum() + (finite_where(want_lse, want_lse) * grad_lse).sum(), inputs)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert_close(a, b, name)


# ----------------------------------------------------------------------------------------------
# qkv- and kv-packed variants
# ----------------------------------------------------------------------------------------------


def _capture(monkeypatch, name):
    """Record the q/k/v the core receives (to check they are views of the packed tensor)."""
    seen = []
    core = getattr(fai, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q, k, v))
        return core(q, k, v, *args, **kwargs)

    monkeypatch.setattr(fai, name, spy)
    return seen


def _same_storage(packed, tensors):
    return all(t.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr() for t in tensors)


@pytest.mark.parametrize("variant", ["qkv", "kv"])
def test_dense_packed_variants_are_views_of_the_packed_tensor(monkeypatch, variant):
    torch.manual_seed(4)
    H_kv = 2 if variant == "kv" else 4
    q = torch.randn(2, 6, 4, 8, dtype=F64, requires_grad=True)
    packed = torch.randn(2, 6, 3 if variant == "qkv" else 2, H_kv, 8, dtype=F64, requires_grad=True)
    sink = torch.randn(4, dtype=F64, requires_grad=True)
    seen = _capture(monkeypatch, "attention")
    if variant == "qkv":
        out, lse, _ = fai.flash_attn_qkvpacked_func(packed, 0.0, None, True, (3, -1), return_attn_probs=True, learnable_sink=sink)
        parts = packed.unbind(2)
    else:
        out, lse, _ = fai.flash_attn_kvpacked_func(q, packed, 0.0, None, True, (3, -1), return_attn_probs=True, learnable_sink=sink)
        parts = (q, *packed.unbind(2))
    assert _same_storage(packed, seen[0][0 if variant == "qkv" else 1 :])
    want_out, want_lse = reference(*parts, causal=True, window=(3, -1), sink=sink)
    assert_close(out, want_out, "out")
    assert_close(lse, want_lse, "lse")
    got = torch.autograd.grad(out.square().sum() + lse.sum(), (packed, sink))
    want = torch.autograd.grad(want_out.square().sum() + want_lse.sum(), (packed, sink))
    assert_close(got[0], want[0], f"d{variant}")
    assert_close(got[1], want[1], "dsink")


@pytest.mark.parametrize("variant", ["qkv", "kv"])
def test_varlen_packed_variants_are_views_of_the_packed_tensor(monkeypatch, variant):
    torch.manual_seed(5)
    cu = [0, 3, 8, 9]
    q = torch.randn(9, 4, 8, dtype=F64, requires_grad=True)
    packed = torch.randn(9, 3 if variant == "qkv" else 2, 4 if variant == "qkv" else 2, 8, dtype=F64, requires_grad=True)
    seen = _capture(monkeypatch, "varlen_attention")
    cu_t = torch.tensor(cu, dtype=torch.int32)
    if variant == "qkv":
        out, lse, _ = fai.flash_attn_varlen_qkvpacked_func(packed, cu_t, 5, 0.0, None, True, return_attn_probs=True)
        parts = packed.unbind(1)
    else:
        out, lse, _ = fai.flash_attn_varlen_kvpacked_func(q, packed, cu_t, cu_t, 5, 5, 0.0, None, True, return_attn_probs=True)
        parts = (q, *packed.unbind(1))
    assert _same_storage(packed, seen[0][0 if variant == "qkv" else 1 :])
    want_out, want_lse = varlen_reference(*parts, cu, cu, causal=True)
    assert_close(out, want_out, "out")
    assert_close(lse, want_lse, "lse")
    got = torch.autograd.grad(out.square().sum() + lse.sum(), packed)[0]
    assert_close(got, torch.autograd.grad(want_out.square().sum() + want_lse.sum(), packed)[0], f"d{variant}")


# ----------------------------------------------------------------------------------------------
# Unsupported and bad arguments
# ----------------------------------------------------------------------------------------------

_Q, _K = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
_CU = torch.tensor([0, 4], dtype=torch.int32)
UNSUPPORTED = [
    ("flash_attn_func", dict(dropout_p=0.1), "dropout_p"),
    ("flash_attn_func", dict(softcap=30.0), "softcap"),
    ("flash_attn_func", dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
    ("flash_attn_varlen_func", dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), "block_table"),
    ("flash_attn_varlen_func", dict(dropout_p=0.5), "dropout_p"),
    ("flash_attn_with_kvcache", dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), "block_table"),
    ("flash_attn_with_kvcache", dict(rotary_cos=torch.ones(8, 4), rotary_sin=torch.ones(8, 4)), "rotary_cos"),
    ("flash_attn_with_kvcache", dict(cache_batch_idx=torch.zeros(1, dtype=torch.int32)), "cache_batch_idx"),
    ("flash_attn_with_kvcache", dict(cache_leftpad=torch.zeros(1, dtype=torch.int32)), "cache_leftpad"),
    ("flash_attn_with_kvcache", dict(softcap=5.0), "softcap"),
    ("flash_attn_with_kvcache", dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
]


def _call(name, **kwargs):
    if name == "flash_attn_varlen_func":
        return fai.flash_attn_varlen_func(_Q[0], _K[0], _K[0], _CU, _CU, 4, 4, **kwargs)
    if name == "flash_attn_with_kvcache":
        return fai.flash_attn_with_kvcache(_Q, _K, _K, **kwargs)
    return getattr(fai, name)(_Q, _K, _K, **kwargs)


@pytest.mark.parametrize("name, kwargs, argument", UNSUPPORTED, ids=[f"{n}-{a}" for n, _, a in UNSUPPORTED])
def test_unsupported_arguments_raise_naming_them_before_any_kernel(name, kwargs, argument):
    with pytest.raises(NotImplementedError, match=argument):
        _call(name, **kwargs)
    assert no_kernel_ran()


@pytest.mark.parametrize("dropout_p", [0.0, 0])
def test_dropout_zero_is_accepted(dropout_p):
    assert torch.equal(fai.flash_attn_func(_Q, _K, _K, dropout_p), fai.flash_attn_func(_Q, _K, _K))


BAD = [
    (dict(window_size=(-2, 0)), ValueError, "left bound must be >= 0, or -1 for unbounded; got -2"),
    (dict(window_size=(1.5, 0)), TypeError, r"window_size left bound must be an int .* got 1.5"),
    (dict(window_size=(1, 2, 3)), ValueError, r"window_size must be a \(left, right\) pair, got \(1, 2, 3\)"),
    (dict(causal="yes"), TypeError, "causal must be a bool, got 'yes'"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool, got 1"),
    (dict(dropout_p="0"), TypeError, "dropout_p must be a float, got '0'"),
    # FlashAttention's names, not the core's: softmax_scale is its scale.
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float or None, got '0.1'"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite, got inf"),
    (dict(return_attn_probs="no"), TypeError, "return_attn_probs must be a bool, got 'no'"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD)
def test_bad_arguments_raise_naming_the_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        fai.flash_attn_func(_Q, _K, _K, **kwargs)
    assert no_kernel_ran()


def test_bad_layouts_name_flash_attentions_layout():
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, seqlen, nheads, headdim\), got shape \(4, 2, 8\)"):
        fai.flash_attn_func(_Q[0], _K, _K)
    with pytest.raises(ValueError, match=r"qkv must hold 3 tensors along dim 2, .* got shape \(1, 4, 2, 2, 8\)"):
        fai.flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 8))
    with pytest.raises(ValueError, match=r"k must be 3-D \(total_tokens, nheads, headdim\), got shape \(1, 4, 2, 8\)"):
        fai.flash_attn_varlen_func(_Q[0], _K, _K[0], _CU, _CU, 4, 4)
    assert no_kernel_ran()


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


def _cache_case(seed, B=3, S_cache=9, H_kv=2, G=2, D=8, S_new=2, S_q=2):
    torch.manual_seed(seed)
    H = H_kv * G
    return (
        torch.randn(B, S_q, H, D, dtype=F64),
        torch.randn(B, S_cache, H_kv, D, dtype=F64),
        torch.randn(B, S_cache, H_kv, D, dtype=F64),
        torch.randn(B, S_new, H_kv, D, dtype=F64),
        torch.randn(B, S_new, H_kv, D, dtype=F64),
        torch.randn(H, dtype=F64),
    )


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(2, 0)), dict(), dict(causal=True, window=(1, 3))])
@pytest.mark.parametrize("seqlens_dtype", [torch.int32, torch.int64])
def test_kvcache_writes_the_new_keys_in_place_and_attends_bottom_right(options, seqlens_dtype):
    q, k_cache, v_cache, k, v, sink = _cache_case(6)
    lengths = [3, 0, 7]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        expected_k[b, n : n + 2], expected_v[b, n : n + 2] = k[b], v[b]
    out, lse = fai.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=torch.tensor(lengths, dtype=seqlens_dtype),
        causal=options.get("causal", False),
        window_size=options.get("window", (-1, -1)),
        return_softmax_lse=True,
        learnable_sink=sink,
    )
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    want_out, want_lse = reference(q, expected_k, expected_v, sink=sink, kv_lengths=[n + 2 for n in lengths], **options)
    assert_close(out, want_out, "out")
    assert_close(lse, want_lse, "lse")


def test_kvcache_int_lengths_and_no_new_keys():
    q, k_cache, v_cache, k, v, _ = _cache_case(7)
    caches = (k_cache.clone(), v_cache.clone())
    by_int = fai.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=4, causal=True)
    assert_close(by_int, reference(q, *caches, causal=True, kv_lengths=[6, 6, 6])[0], "int cache_seqlens")
    # Without new keys: attend to the first cache_seqlens keys; without cache_seqlens, to the whole cache, untouched.
    assert_close(fai.flash_attn_with_kvcache(q, *caches, cache_seqlens=torch.tensor([6, 6, 6]), causal=True), by_int, "no new keys")
    before = [t.clone() for t in caches]
    whole = fai.flash_attn_with_kvcache(q, *caches, causal=True, window_size=(3, 0))
    assert_close(whole, reference(q, *caches, causal=True, window=(3, 0))[0], "whole cache")
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_kvcache_larger_cache_batch_leaves_other_rows_alone():
    q, k_cache, v_cache, k, v, _ = _cache_case(8)
    q, k, v = q[:2], k[:2], v[:2]
    untouched = k_cache[2].clone(), v_cache[2].clone()
    out = fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([1, 5]), causal=True)
    assert torch.equal(k_cache[2], untouched[0]) and torch.equal(v_cache[2], untouched[1])
    assert_close(out, reference(q, k_cache[:2], v_cache[:2], causal=True, kv_lengths=[3, 7])[0], "out")


@pytest.mark.parametrize(
    "cache_seqlens, message",
    [
        (torch.tensor([3, 8, 0]), r"cache_seqlens must lie in \[0, 7\] \(the cache length less the new keys\), got \[3, 8, 0\]"),
        (torch.tensor([3, -1, 0]), r"cache_seqlens must lie in \[0, 7\] .* got \[3, -1, 0\]"),
        (8, r"cache_seqlens must lie in \[0, 7\] .* got 8"),
        (None, "pass cache_seqlens with them"),
        (torch.tensor([1.0, 2.0, 3.0]), "cache_seqlens must be int32 or int64, got torch.float32"),
    ],
)
def test_kvcache_bad_lengths_raise_and_leave_the_cache_alone(cache_seqlens, message):
    q, k_cache, v_cache, k, v, _ = _cache_case(9)
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises((ValueError, TypeError), match=message):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]) and no_kernel_ran()


def test_kvcache_mismatched_new_keys_raise_and_leave_the_cache_alone():
    q, k_cache, v_cache, k, v, sink = _cache_case(10)
    before = k_cache.clone()
    lengths = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="k and v must be given together, got k=a tensor and v=None"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, cache_seqlens=lengths)
    with pytest.raises(ValueError, match=r"k must have shape \(3, 2, 2, 8\) .* got \(3, 2, 1, 8\)"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k[:, :, :1], v, cache_seqlens=lengths)
    with pytest.raises(ValueError, match="v must match its cache's dtype and device"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, v.float(), cache_seqlens=lengths)
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, learnable_sink=sink[:3])
    with pytest.raises(TypeError, match="softmax_scale must be a float or None, got '0.1'"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, softmax_scale="0.1")
    with pytest.raises(TypeError, match="return_softmax_lse must be a bool, got 'no'"):
        fai.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, return_softmax_lse="no")
    assert torch.equal(k_cache, before) and no_kernel_ran()


# ----------------------------------------------------------------------------------------------
# deterministic
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def backward_graphs(monkeypatch):
    """The cuDNN launch code on CPU with emulated graphs (``emulated_cudnn``); records, for every backward launch, the
    algorithm its graph was resolved for (``deterministic``)."""
    from support.emulated_cudnn import emulated

    with emulated(monkeypatch) as launches:
        yield launches["algorithms"], launches


@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_deterministic_backward_resolves_cudnns_deterministic_graph(backward_graphs, api):
    """``deterministic=True`` reaches the cuDNN backward as the core's per-call ``deterministic`` option, for that
    call alone (torch's global setting is not touched); the gradients (output's and LSE's, sinks included) are the
    plain call's and the reference's."""
    asked, launches = backward_graphs
    q, k, v, sink = leaves((1, 6, 4, 8), (1, 6, 2, 8), (1, 6, 2, 8), (4,), seed=11)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)

    def call(deterministic):
        if api == "dense":
            out, lse, _ = fai.flash_attn_func(
                q, k, v, causal=True, deterministic=deterministic, return_attn_probs=True, learnable_sink=sink
            )
        else:
            out, lse, _ = fai.flash_attn_varlen_func(
                q[0], k[0], v[0], cu, cu, 4, 4, causal=True, deterministic=deterministic, return_attn_probs=True, learnable_sink=sink
            )
            out, lse = out[None], lse[None]
        return torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v, sink))

    plain = call(False)
    assert asked == [False, False] and launches["backward"] == 2  # the output's launch and the LSE's
    deterministic = call(True)
    assert asked == [False, False, True, True] and not torch.are_deterministic_algorithms_enabled()
    if api == "dense":
        want_out, want_lse = reference(q, k, v, causal=True, sink=sink)
    else:
        want_out, want_lse = varlen_reference(q[0], k[0], v[0], [0, 2, 6], [0, 2, 6], causal=True, sink=sink)
        want_out, want_lse = want_out[None], want_lse[None]
    want = torch.autograd.grad(want_out.square().sum() + want_lse.sum(), (q, k, v, sink))
    for name, a, b, c in zip(("dq", "dk", "dv", "dsink"), deterministic, plain, want):
        assert torch.equal(a, b), name
        # The launch code keeps the LSE in float32, as cuDNN writes it: float32 accuracy.
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_deterministic_false_follows_torchs_setting(backward_graphs, monkeypatch):
    # FlashAttention's default asks nothing: the backward runs what torch's global setting says when it runs.
    asked, _ = backward_graphs
    q, k, v = leaves((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8), seed=12)
    out = fai.flash_attn_func(q, k, v, deterministic=False)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    out.sum().backward()
    assert asked == [True]


def test_deterministic_without_gradients_runs_plainly():
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=F64) for _ in range(3))
    out = fai.flash_attn_func(q, k, v, deterministic=True)
    assert out.grad_fn is None
    assert torch.equal(out, fai.flash_attn_func(q, k, v))


def test_deterministic_under_compile_traces_and_matches_eager():
    # The option travels in the op's arguments, so a compiled call needs no global setting.
    q, k, v = leaves((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8), seed=13)
    compiled = torch.compile(lambda q, k, v: fai.flash_attn_func(q, k, v, deterministic=True), backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), fai.flash_attn_func(q, k, v, deterministic=True))
