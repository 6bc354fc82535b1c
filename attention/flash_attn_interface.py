"""FlashAttention's Python API on cuDNN: code written for ``flash_attn`` changes one import.

    from cudnn_attention.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

The functions take FlashAttention 2's arguments in FlashAttention 2's order (``flash_attn/flash_attn_interface.py``),
so positional calls keep working; that is why, unlike the rest of this package, they are not keyword-only. One
argument is added, keyword-only: FlashAttention 4's ``learnable_sink``. Tensors are FlashAttention's: (B, S, H, D)
dense, (T, H, D) packed, (B, S_cache, H_kv, D) for a KV cache. Each call goes to :func:`cudnn_attention.attention`
or :func:`cudnn_attention.varlen_attention` as transposed views (no copies), and the output comes back as a view in
FlashAttention's layout: cuDNN where it serves the call, the exact path otherwise, counted in
:func:`cudnn_attention.stats` and refused in strict mode, as for every call of this package.

Semantics, as FlashAttention documents them:

* ``window_size=(left, right)``: query ``i`` sees key ``j`` iff
  ``i + S_kv - S_q - left <= j <= i + S_kv - S_q + right``, -1 (or FlashAttention 4's None) leaving a side
  unbounded; ``causal=True`` sets ``right = 0`` whatever ``window_size[1]`` says. The diagonal is anchored at
  the bottom right (the last query sees the last key) when S_q != S_kv, per document for packed calls and per
  sequence for a KV cache. A row that sees no key outputs zero.
* ``softmax_scale=None`` is ``1 / sqrt(D)``.
* ``learnable_sink`` (H_q,): one logit per query head that joins its softmax denominator and carries no value
  (FlashAttention 4, gpt-oss); differentiable.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: FlashAttention 2's triple, whose last item
  (the dropout pattern) is None without dropout there too. ``softmax_lse`` is (B, H_q, S_q) dense and
  (H_q, T_q) packed, float32 (float64 for float64 inputs), the sink included, and differentiable (a loss may
  use it, as FlashAttention 4 allows).
* ``deterministic=True``: this call's backward runs cuDNN's deterministic algorithm (the core's per-call
  ``deterministic`` option, eager and compiled alike); the forward is deterministic anyway. ``False``, FlashAttention's
  default, asks nothing: the backward follows ``torch.are_deterministic_algorithms_enabled()``.

Differences, each an error raised before any kernel runs rather than a silent change: ``dropout_p`` other
than 0, ``softcap`` other than 0, ``alibi_slopes``, ``block_table`` (paged KV cache), ``rotary_cos`` /
``rotary_sin``, ``cache_batch_idx`` and ``cache_leftpad`` are not supported. A ``window_size`` bound below -1
is an error (FlashAttention reads any negative bound as -1). Rows that see no key have ``softmax_lse = -inf``
(FlashAttention 2 writes +inf there). ``num_splits`` and ``rotary_interleaved`` are accepted and change
nothing. FlashAttention 2 also reads a bound at or beyond the key length as unbounded, which differs from the
formula above only for a right bound when S_q > S_kv; these functions follow the formula.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _compat, validation
from .api import attention, varlen_attention

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

_DENSE = "(batch, seqlen, nheads, headdim)"
_PACKED = "(total_tokens, nheads, headdim)"


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _refuse_unsupported(dropout_p=0.0, softcap=0.0, **absent) -> None:
    """FlashAttention options cuDNN attention does not compute: an error naming the first one given."""
    for name, value in (("dropout_p", dropout_p), ("softcap", softcap)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
        if value != 0:
            raise NotImplementedError(f"{name}={value!r} is not supported by cudnn_attention.flash_attn_interface; only {name}=0.0 is")
    for name, value in absent.items():
        if value is not None:
            raise NotImplementedError(f"{name} is not supported by cudnn_attention.flash_attn_interface; pass {name}=None")


def _window(window_size, causal) -> tuple[int, int]:
    """FlashAttention's ``(window_size, causal)`` as one ``(left, right)`` band: -1 (or None) unbounded, and
    ``causal`` setting ``right = 0`` whatever was asked (FlashAttention's rule; the core refuses the mix)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a (left, right) pair, got {window_size!r}")
    bounds = []
    for side, bound in zip(("left", "right"), window_size):
        if bound is None:
            bound = -1
        elif isinstance(bound, bool) or not isinstance(bound, int):
            raise TypeError(f"window_size {side} bound must be an int (-1 or None for unbounded), got {bound!r} ({type(bound).__name__})")
        elif bound < -1:
            raise ValueError(f"window_size {side} bound must be >= 0, or -1 for unbounded; got {bound}")
        bounds.append(bound)
    return bounds[0], 0 if validation.check_flag(causal, "causal") else bounds[1]


def _tensor(t, name: str, rank: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
    return t


def _unpack(packed, name: str, axis: int, count: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Views of a stacked ``qkv`` / ``kv`` tensor along ``axis`` (no copies; autograd sums their gradients back)."""
    _tensor(packed, name, axis + 3, layout)
    if packed.shape[axis] != count:
        raise ValueError(f"{name} must hold {count} tensors along dim {axis}, {layout}; got shape {tuple(packed.shape)}")
    return packed.unbind(axis)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    # (B, S, H, D) <-> (B, H, S, D): a view each way; attention() serves it without a copy and writes its output in the same order.
    return t.transpose(1, 2)


def _deterministic(options) -> bool | None:
    """The core's ``deterministic`` for FlashAttention's flag: True asks for it, False leaves torch's setting in charge."""
    return True if validation.check_flag(options.deterministic, "deterministic") else None


class _Options(NamedTuple):
    """The arguments every dense and packed function shares, by FlashAttention's names."""

    dropout_p: float
    softmax_scale: float | None
    causal: bool
    window_size: tuple
    softcap: float
    alibi_slopes: torch.Tensor | None
    deterministic: bool
    return_attn_probs: bool
    learnable_sink: torch.Tensor | None


def _checked(options: _Options) -> bool:
    """Check the options the core would name otherwise (``softmax_scale`` is its ``scale``); returns whether the LSE is
    asked for (``return_attn_probs``)."""
    validation.resolve_scale(options.softmax_scale, 1, name="softmax_scale")
    return validation.check_flag(options.return_attn_probs, "return_attn_probs")


def _returned(outputs: tuple, return_attn_probs):
    # FlashAttention 2's contract: out alone, or (out, softmax_lse, S_dmask) with S_dmask None when there is no dropout.
    return (outputs[0], outputs[1], None) if return_attn_probs else outputs[0]


# ----------------------------------------------------------------------------------------------
# Dense (B, S, H, D)
# ----------------------------------------------------------------------------------------------


def _dense(q, k, v, options: _Options):
    _refuse_unsupported(options.dropout_p, options.softcap, alibi_slopes=options.alibi_slopes)
    window = _window(options.window_size, options.causal)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(t, name, 4, _DENSE)
    want_lse = _checked(options)

    def compute(q, k, v, sinks):
        result = attention(
            _bshd(q),
            _bshd(k),
            _bshd(v),
            scale=options.softmax_scale,
            window_size=window,
            bottom_right=True,
            sinks=sinks,
            return_lse=want_lse,
            deterministic=_deterministic(options),
        )
        return (_bshd(result[0]), result[1]) if want_lse else (_bshd(result),)

    return _returned(compute(q, k, v, options.learnable_sink), want_lse)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """FlashAttention's ``flash_attn_func`` on cuDNN (see the module docstring for the semantics).

    Args:
        q: (B, S_q, H_q, D). k, v: (B, S_kv, H_kv, D) and (B, S_kv, H_kv, D_v); H_q a multiple of H_kv (GQA/MQA).
        dropout_p: must be 0.0. softcap: must be 0.0. alibi_slopes: must be None.
        softmax_scale: default ``1 / sqrt(D)``.
        causal: ``window_size``'s right bound becomes 0; bottom-right aligned when S_q != S_kv.
        window_size: ``(left, right)``, -1 or None unbounded.
        deterministic: run this call's backward with deterministic algorithms.
        return_attn_probs: also return the LSE, as ``(out, softmax_lse (B, H_q, S_q), None)``.
        learnable_sink: (H_q,) sink logits (FlashAttention 4's), keyword-only; differentiable.

    Returns:
        ``out`` (B, S_q, H_q, D_v) in q's dtype (a transposed view of a (B, H, S, D)-shaped result laid out as q
        is), or ``(out, softmax_lse, None)``.
    """
    options = _Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink
    )
    return _dense(q, k, v, options)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """:func:`flash_attn_func` over ``qkv`` (B, S, 3, H, D), unbound into views (the gradient comes back as one tensor).

    Returns ``out`` (B, S, H, D), or ``(out, softmax_lse (B, H, S), None)`` with ``return_attn_probs``.
    """
    q, k, v = _unpack(qkv, "qkv", 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    options = _Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink
    )
    return _dense(q, k, v, options)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """:func:`flash_attn_func` with ``kv`` (B, S_kv, 2, H_kv, D) unbound into k and v views.

    Returns ``out`` (B, S_q, H_q, D), or ``(out, softmax_lse (B, H_q, S_q), None)`` with ``return_attn_probs``.
    """
    k, v = _unpack(kv, "kv", 2, 2, "(batch, seqlen, 2, nheads_k, headdim)")
    options = _Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink
    )
    return _dense(q, k, v, options)


# ----------------------------------------------------------------------------------------------
# Packed documents (T, H, D)
# ----------------------------------------------------------------------------------------------


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options: _Options):
    _refuse_unsupported(options.dropout_p, options.softcap, alibi_slopes=options.alibi_slopes)
    window = _window(options.window_size, options.causal)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(t, name, 3, _PACKED)
    want_lse = _checked(options)

    def compute(q, k, v, sinks):
        result = varlen_attention(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            scale=options.softmax_scale,
            window_size=window,
            bottom_right=True,
            sinks=sinks,
            return_lse=want_lse,
            deterministic=_deterministic(options),
        )
        return (result[0], result[1].t()) if want_lse else (result,)  # FlashAttention's packed LSE is (H, T): a view of ours

    return _returned(compute(q, k, v, options.learnable_sink), want_lse)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    learnable_sink=None,
):
    """FlashAttention's ``flash_attn_varlen_func`` on cuDNN: packed documents (see the module docstring).

    Args:
        q: (T_q, H_q, D). k, v: (T_kv, H_kv, D) and (T_kv, H_kv, D_v).
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 (or int64) prefix sums of the documents' lengths; document b is
            tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``. Checked as :func:`cudnn_attention.varlen_attention` checks them
            (its errors call them ``cu_seqlens_q``/``cu_seqlens_kv``).
        max_seqlen_q, max_seqlen_k: Python ints bounding the longest document of each side.
        block_table: must be None (no paged KV cache). Other arguments as in :func:`flash_attn_func`; windows,
            ``causal`` and the bottom-right alignment apply per document.

    Returns:
        ``out`` (T_q, H_q, D_v), or ``(out, softmax_lse (H_q, T_q), None)`` with ``return_attn_probs``; tokens past
        ``cu_seqlens_q[-1]`` get a zero output and ``-inf``.
    """
    _refuse_unsupported(block_table=block_table)
    options = _Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink
    )
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """:func:`flash_attn_varlen_func` over ``qkv`` (T, 3, H, D), unbound into views, with one ``cu_seqlens`` and ``max_seqlen``.

    Returns ``out`` (T, H, D), or ``(out, softmax_lse (H, T), None)`` with ``return_attn_probs``.
    """
    q, k, v = _unpack(qkv, "qkv", 1, 3, "(total_tokens, 3, nheads, headdim)")
    options = _Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink
    )
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, options)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """:func:`flash_attn_varlen_func` with ``kv`` (T_kv, 2, H_kv, D) unbound into k and v views.

    Returns ``out`` (T_q, H_q, D), or ``(out, softmax_lse (H_q, T_q), None)`` with ``return_attn_probs``.
    """
    k, v = _unpack(kv, "kv", 1, 2, "(total_tokens, 2, nheads_k, headdim)")
    options = _Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink
    )
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)


# ----------------------------------------------------------------------------------------------
# KV cache (B, S_cache, H_kv, D)
# ----------------------------------------------------------------------------------------------


def _cache_lengths(cache_seqlens, batch: int, room: int, device: torch.device) -> torch.Tensor | None:
    """``cache_seqlens`` as a (B,) integer tensor on the cache's device, each length in ``[0, room]`` (room: the
    cache length less the new keys, which must fit after it). An int or a CPU tensor is checked on the host; a
    CUDA tensor by a device-side assertion queued ahead of the write (no host read), which stops the process
    instead of writing or reading past the cache."""
    if cache_seqlens is None:
        return None
    message = f"cache_seqlens must lie in [0, {room}] (the cache length less the new keys)"
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= room:
            raise ValueError(f"{message}, got {cache_seqlens}")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int or a ({batch},) int32 tensor, got {type(cache_seqlens).__name__}")
    validation.check_seqlens(cache_seqlens, "cache_seqlens", batch, device)
    if batch == 0:
        return cache_seqlens
    if cache_seqlens.is_cuda or torch.compiler.is_compiling():
        low, high = torch.aminmax(cache_seqlens)
        _compat.assert_on_device((low >= 0) & (high <= room), f"cudnn_attention: {message}")
    elif (cache_seqlens < 0).any() or (cache_seqlens > room).any():
        raise ValueError(f"{message}, got {cache_seqlens.tolist()}")
    return cache_seqlens


def _check_new_keys(k, v, k_cache, v_cache, batch: int) -> None:
    """The new keys and values: (B, S_new, H_kv, D) and (B, S_new, H_kv, D_v), the caches' dtype and device."""
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
        _tensor(new, name, 4, "(batch, seqlen_new, nheads_k, headdim)")
        want = (batch, k.shape[1], *cache.shape[2:])
        if tuple(new.shape) != want:
            raise ValueError(
                f"{name} must have shape {want} (batch, seqlen_new and the cache's heads and head dim), got {tuple(new.shape)}"
            )
        if new.dtype != cache.dtype or new.device != cache.device:
            raise ValueError(
                f"{name} must match its cache's dtype and device ({cache.dtype}, {cache.device}), got {new.dtype}, {new.device}"
            )


def _write_into(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> None:
    """``cache[b, positions[b, t]] = new[b, t]`` in place, on the device (a scatter: no host read)."""
    index = positions.view(*positions.shape, 1, 1).expand(-1, -1, new.shape[2], new.shape[3])
    cache.scatter_(1, index, new)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    learnable_sink=None,
):
    """FlashAttention's ``flash_attn_with_kvcache`` on cuDNN, for a contiguous (not paged) cache.

    With ``k`` and ``v``, they are first written into ``k_cache``/``v_cache`` in place, batch row b at positions
    ``cache_seqlens[b]`` onwards; then q attends to each row's first ``cache_seqlens[b] + S_new`` keys (all of
    the cache without ``cache_seqlens``), bottom-right aligned: the queries are the last S_q positions, which is
    what ``causal`` and windows are measured from.

    Args:
        q: (B, S_q, H_q, D).
        k_cache, v_cache: (B_cache, S_cache, H_kv, D) and (B_cache, S_cache, H_kv, D_v), B_cache >= B; rows past B
            are left alone (FlashAttention's default ``cache_batch_idx``).
        k, v: None, or (B, S_new, H_kv, D) and (B, S_new, H_kv, D_v) in the caches' dtype; needs ``cache_seqlens``.
        cache_seqlens: None, an int, or a (B,) int32/int64 tensor on the caches' device: the valid length of each
            row before the write, in ``[0, S_cache - S_new]`` (checked: on the host for an int or a CPU tensor, by a
            device-side assertion for a CUDA one, which stops the process rather than write outside the cache).
        rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes: must be None.
        softcap: must be 0.0. num_splits, rotary_interleaved: accepted, unused.
        softmax_scale, causal, window_size, learnable_sink: as in :func:`flash_attn_func`.
        return_softmax_lse: also return the LSE (B, H_q, S_q).

    Returns:
        ``out`` (B, S_q, H_q, D_v), or ``(out, softmax_lse)``. Differentiable through q, the sinks and the caches
        as written (FlashAttention's has no backward).

    Every argument is checked before the cache is written, so a rejected call leaves it as it was.
    """
    _refuse_unsupported(
        0.0,
        softcap,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=block_table,
        alibi_slopes=alibi_slopes,
    )
    window = _window(window_size, causal)
    _tensor(q, "q", 4, _DENSE)
    _tensor(k_cache, "k_cache", 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _tensor(v_cache, "v_cache", 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    batch = q.shape[0]
    if k_cache.shape[0] < batch or v_cache.shape[0] < batch:
        raise ValueError(
            f"k_cache and v_cache must hold at least the {batch} batch rows of q, got {k_cache.shape[0]} and {v_cache.shape[0]}"
        )
    k_cache, v_cache = k_cache[:batch], v_cache[:batch]  # views; FlashAttention uses the first B rows likewise
    validation.check_qkv(_bshd(q), _bshd(k_cache), _bshd(v_cache), packed=False)
    validation.check_sinks(learnable_sink, q, q.shape[2])
    validation.resolve_scale(softmax_scale, q.shape[-1], name="softmax_scale")
    return_softmax_lse = validation.check_flag(return_softmax_lse, "return_softmax_lse")
    if (k is None) != (v is None):
        raise ValueError(
            f"k and v must be given together, got k={'None' if k is None else 'a tensor'} and v={'None' if v is None else 'a tensor'}"
        )
    new = 0
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("k and v are written into the cache at cache_seqlens: pass cache_seqlens with them")
        _check_new_keys(k, v, k_cache, v_cache, batch)
        new = k.shape[1]
    lengths = _cache_lengths(cache_seqlens, batch, k_cache.shape[1] - new, k_cache.device)
    if new:
        positions = lengths.view(batch, 1).long() + torch.arange(new, device=k_cache.device)
        _write_into(k_cache, k, positions)
        _write_into(v_cache, v, positions)
        lengths = lengths + new
    result = attention(
        _bshd(q),
        _bshd(k_cache),
        _bshd(v_cache),
        scale=softmax_scale,
        window_size=window,
        bottom_right=True,
        sinks=learnable_sink,
        seqlens_kv=lengths,
        return_lse=return_softmax_lse,
    )
    return (_bshd(result[0]), result[1]) if return_softmax_lse else _bshd(result)
