"""Validating a call into one :class:`~cudnn_attention.call.Prepared` value: dense (:func:`prepare_dense`), packed
(:func:`prepare_packed`) and the arguments of torch's attention ops the provider overrides (:func:`prepare_aten`).
Every error names the offending value, before any kernel runs.

Legend: B batch, H heads, S sequence, D head dim, T packed tokens.
"""

from __future__ import annotations

from . import validation
from .call import NO_LENGTHS, AttentionCall, Lengths, Prepared, needs_grad, padding_lengths
from .layouts import token_major
from .masking import make_mask_spec
from .op_args import OP_OPTIONS
from .packed_batch import registered_batch

__all__ = ["prepare_aten", "prepare_dense", "prepare_packed"]


def prepare_dense(
    q, k, v, *, scale, causal, bottom_right, window_size, sinks, seqlens_q, seqlens_kv, return_lse, validate, grad=None, key=None, **options
) -> Prepared:
    """Validate a dense (B, H, S, D) call (see :func:`cudnn_attention.attention`; errors name the value).

    ``grad``: whether a backward follows (None: from the tensors, :func:`needs_grad`). ``key``: the
    arguments' key, kept only if no tensor had to be replaced on the way. ``options``: the call's
    :data:`OP_OPTIONS` other than the scale, as the caller passed them."""
    given = (q, k, v)
    q, k, v = validation.check_qkv(q, k, v, packed=False)
    causal, bottom_right, return_lse, validate = _flags(causal, bottom_right, return_lse, validate)
    mask = make_mask_spec(causal=causal, bottom_right=bottom_right, window_size=window_size)
    q, scale = validation.positive_scale(q, validation.resolve_scale(scale, q.shape[-1]))
    sinks = validation.check_sinks(sinks, q, q.shape[1])
    B, S_q, S_kv = q.shape[0], q.shape[2], k.shape[2]
    seqlens_q = validation.check_seqlens(seqlens_q, "seqlens_q", B, q.device)
    seqlens_kv = validation.check_seqlens(seqlens_kv, "seqlens_kv", B, q.device)
    if validate:
        for name, lengths, limit in (("seqlens_q", seqlens_q, S_q), ("seqlens_kv", seqlens_kv, S_kv)):
            if lengths is not None:
                validation.validate_seqlens(lengths, name, limit)
    padded = seqlens_q is not None or seqlens_kv is not None
    lengths = padding_lengths(seqlens_q, seqlens_kv, B, S_q, S_kv, q.device) if padded else NO_LENGTHS
    grad = needs_grad(q, k, v, sinks) if grad is None else grad
    call = _attention_call(
        sinks, grad, return_lse, options, packed=False, padded=padded, max_seqlen_q=S_q, max_seqlen_kv=S_kv, scale=scale, mask=mask
    )
    return Prepared(call, q, k, v, sinks, lengths, key if _unchanged(given, q, k, v) else None)


def prepare_packed(
    q,
    k,
    v,
    *,
    cu_seqlens_q,
    cu_seqlens_kv,
    max_seqlen_q,
    max_seqlen_kv,
    scale,
    causal,
    bottom_right,
    window_size,
    sinks,
    return_lse,
    validate,
    grad=None,
    key=None,
    **options,
) -> Prepared:
    """Validate a packed (T, H, D) call (see :func:`cudnn_attention.varlen_attention`), as
    :func:`prepare_dense` does a dense one. A training call's q/k/v become token-major (see
    :func:`~cudnn_attention.layouts.token_major`: cuDNN's packed backward needs it)."""
    given = (q, k, v)
    q, k, v = validation.check_qkv(q, k, v, packed=True)
    causal, bottom_right, return_lse, validate = _flags(causal, bottom_right, return_lse, validate)
    max_seqlen_q, max_seqlen_kv = validation.check_cu_seqlens(
        cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, q.device, total_q=q.shape[0], total_kv=k.shape[0]
    )
    mask = make_mask_spec(causal=causal, bottom_right=bottom_right, window_size=window_size)
    q, scale = validation.positive_scale(q, validation.resolve_scale(scale, q.shape[-1]))
    sinks = validation.check_sinks(sinks, q, q.shape[1])
    batch = registered_batch(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0])
    batch = batch.check(max_seqlen_q, max_seqlen_kv, validate=validate, cover_all=False)
    grad = needs_grad(q, k, v, sinks) if grad is None else grad
    if grad:
        q, k, v = token_major(q), token_major(k), token_major(v)
    call = _attention_call(
        sinks,
        grad,
        return_lse,
        options,
        packed=True,
        documents=cu_seqlens_q.shape[0] - 1,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        scale=scale,
        mask=mask,
    )
    return Prepared(call, q, k, v, sinks, Lengths(batch=batch), key if _unchanged(given, q, k, v) else None)


def prepare_aten(
    query,
    key,
    value,
    *,
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    max_q: int,
    max_kv: int,
    is_causal: bool,
    scale,
    window_size=(-1, -1),
    grad: bool,
) -> Prepared:
    """Validate a call of one of torch's attention ops the provider overrides (``aten::_scaled_dot_product_cudnn_attention``,
    ``torch_attn::_varlen_attn*``), with its arguments' meanings: SDPA's causal mask is top-left aligned; the varlen
    ops run FlashAttention, whose causal/window diagonal is anchored at each document's last query and key (bottom
    right; the same as top left when lengths match). ``grad``: whether a backward follows (the varlen ops cannot see
    it, and always say True so that both directions resolve one plan); a varlen call's q/k/v are then token-major in
    both directions, so the forward's graph and the backward's see one layout."""
    if cu_seqlens_q is None:
        return prepare_dense(
            query,
            key,
            value,
            scale=scale,
            causal=is_causal,
            bottom_right=False,
            window_size=window_size,
            sinks=None,
            seqlens_q=None,
            seqlens_kv=None,
            return_lse=grad,
            validate=False,
            grad=grad,
        )
    query, key, value = token_major(query), token_major(key), token_major(value)
    return prepare_packed(
        query,
        key,
        value,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        scale=scale,
        causal=is_causal,
        bottom_right=True,
        window_size=window_size,
        sinks=None,
        return_lse=grad,
        validate=False,
        grad=grad,
    )


def _flags(causal, bottom_right, return_lse, validate) -> tuple:
    """The call's yes/no arguments, each checked to be a bool (:func:`~cudnn_attention.validation.check_flag`)."""
    # Plain comparisons first: this runs on every call that is not a remembered one.
    if type(causal) is bool and type(bottom_right) is bool and type(return_lse) is bool and type(validate) is bool:
        return causal, bottom_right, return_lse, validate
    names = ("causal", "bottom_right", "return_lse", "validate")
    return tuple(validation.check_flag(value, name) for value, name in zip((causal, bottom_right, return_lse, validate), names))


def _attention_call(sinks, grad: bool, return_lse: bool, options: dict, **fields) -> AttentionCall:
    """The call value of a validated call: ``fields`` (its kind, bounds, scale and mask), what its sinks, gradients and
    LSE ask of the kernels, and its :data:`~cudnn_attention.op_args.OP_OPTIONS` as passed."""
    return AttentionCall(has_sinks=sinks is not None, need_lse=return_lse or grad, needs_grad=grad, **fields, **_checked(options))


def _checked(options: dict) -> dict:
    """The call's :data:`OP_OPTIONS` (but the scale, checked apart) as passed, each a bool or None (every one so far)."""
    for name, value in options.items():
        if name not in OP_OPTIONS or name == "scale":
            raise TypeError(f"unexpected option {name!r}")
        if not (value is None or type(value) is bool):
            raise TypeError(f"{name} must be a bool or None, got {value!r} ({type(value).__name__})")
    return options


def _unchanged(given, q, k, v) -> bool:
    # Identity, not ==: a tuple compares unequal tensors elementwise.
    return given[0] is q and given[1] is k and given[2] is v
