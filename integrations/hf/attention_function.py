"""The attention function behind ``attn_implementation="cudnn"``.

Contract (transformers 5.x): ``fn(module, query, key, value, attention_mask, dropout=, scaling=,
**kwargs) -> (out (B, S_q, H_q, D_v), None)`` with query/key/value (B, H, S, D) transposed views of
(B, S, H, D) and K/V heads not repeated. An ordered ladder, like FlashAttention's:

1. what cuDNN cannot express -> the model's exact eager path, counted and warned (strict: raises);
2. a 2-D padding mask -> valid tokens gathered to the front of each row, the padded cuDNN path
   (padded positions are never computed), and gathered back;
3. ``cu_seq_lens_q/k`` + ``max_length_q/k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)
   -> the packed path, with no host synchronization;
4. packing detected from ``position_ids`` (batch 1, positions restarting) -> the packed path
   (finding the documents reads them on the host, once per forward);
5. dense, causal per transformers' resolution, bottom-right aligned when decoding from a cache.
"""

from __future__ import annotations

import torch

from ...api import _needs_grad, attention, varlen_attention
from ...policy import fallback_output, note_fallback
from .eager_fallback import eager_equivalent, keep_mask_4d
from .mask_function import pad_keys, query_positions

__all__ = ["cudnn_attention_forward"]

_HALF = (torch.float16, torch.bfloat16)


def cudnn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs):
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:  # an explicit kwarg wins over the module (encoders, cross-attention)
        is_causal = getattr(module, "is_causal", True)
    sinks = kwargs.get("s_aux")
    query, key, value = _to_compute_dtype(query, key, value)
    B, H, q_len, _ = query.shape
    kv_len = key.shape[2]

    reason = _inexpressible(attention_mask, dropout, softcap, kwargs)
    if reason is not None:
        return _eager(module, query, key, value, attention_mask, reason, is_causal=is_causal, sliding_window=sliding_window,
                      scaling=scaling, dropout=dropout, softcap=softcap, **kwargs)  # fmt: skip

    options = dict(scale=scaling, causal=is_causal, sinks=sinks)
    if attention_mask is not None:
        return _padded(query, key, value, attention_mask.bool(), window=_window(sliding_window, is_causal, kv_len), **options), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and kwargs.get("max_length_q") is not None:
        max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
        return _packed(query, key, value, cu_q, cu_k, max_q, max_k, window=_window(sliding_window, is_causal, max_k), **options), None

    packing = _packing_from_position_ids(kwargs.get("position_ids"), B, q_len, kv_len)
    if packing is not None:
        (cu_q, cu_k), (max_q, max_k) = packing
        return _packed(query, key, value, cu_q, cu_k, max_q, max_k, window=_window(sliding_window, is_causal, max_k), **options), None

    out = attention(query, key, value, bottom_right=q_len != kv_len, window_size=_window(sliding_window, is_causal, kv_len), **options)
    return out.transpose(1, 2), None


def _to_compute_dtype(query, key, value):
    """Under autocast RoPE can leave query/key in float32 beside a bf16 value: cast them the way
    transformers' flash path does (autocast dtype first, else the half dtype present)."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    if dtypes <= set(_HALF) and len(dtypes) == 1:
        return query, key, value
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        target = torch.get_autocast_dtype(device_type)
    else:
        halves = [t.dtype for t in (value, key, query) if t.dtype in _HALF]
        if not halves:
            return query, key, value  # a float32 model: the core serves it on its exact path, visibly
        target = halves[0]
    return query.to(target), key.to(target), value.to(target)


def _inexpressible(attention_mask, dropout, softcap, kwargs) -> str | None:
    if softcap is not None:
        return "logit softcapping"
    if dropout and dropout > 0:
        return "attention dropout in training"
    if kwargs.get("position_bias") is not None:
        return "an additive position_bias"
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    if attention_mask is not None and attention_mask.dim() != 2:
        return "a 4-D attention mask (model-specific mask functions)"
    return None


def _window(sliding_window, is_causal: bool, longest: int) -> tuple[int, int]:
    """transformers' window W: W keys including self (causal), or |i - j| <= W (bidirectional).
    A window covering every key is dropped, so the faster unbanded graph serves it."""
    if sliding_window is None or sliding_window >= longest:
        return (-1, -1)
    return (sliding_window - 1, 0) if is_causal else (sliding_window, sliding_window)


def _padded(query, key, value, keep_BK, *, window, scale, causal, sinks):
    """Each row's valid tokens (one contiguous run: left or right padding) are gathered to the
    front, served by the padded cuDNN path with per-row lengths, and gathered back; padded query
    rows read zero. Queries are the last ``q_len`` written key positions (a KV cache), so the
    diagonal is bottom-right aligned per row."""
    B, H, q_len, _ = query.shape
    kv_len = key.shape[2]
    keep_BK = pad_keys(keep_BK, kv_len)
    keep_BQ = keep_BK.index_select(1, query_positions(keep_BK, q_len))
    start_kv, len_kv = _first_and_count(keep_BK)
    start_q, len_q = _first_and_count(keep_BQ)
    q_c = _gather_rows(query.transpose(1, 2), start_q, q_len).transpose(1, 2)
    k_c = _gather_rows(key.transpose(1, 2), start_kv, kv_len).transpose(1, 2)
    v_c = _gather_rows(value.transpose(1, 2), start_kv, kv_len).transpose(1, 2)
    out_c = attention(q_c, k_c, v_c, scale=scale, causal=causal, bottom_right=True, window_size=window, sinks=sinks,
                      seqlens_q=len_q, seqlens_kv=len_kv)  # fmt: skip
    # Back to original positions: row p holds compact row p - start, zero outside the valid run.
    position_S = torch.arange(q_len, device=query.device)
    compact_BS = position_S - start_q[:, None]
    valid_BS = (compact_BS >= 0) & (compact_BS < len_q[:, None])
    out_BSHD = _gather_rows(out_c.transpose(1, 2), compact_BS.clamp(0, q_len - 1), q_len, absolute=True)
    return out_BSHD * valid_BS[:, :, None, None].to(out_BSHD.dtype)


def _first_and_count(keep_BL):
    keep_int = keep_BL.to(torch.int32)
    return keep_int.argmax(dim=-1), keep_int.sum(dim=-1, dtype=torch.int32)


def _gather_rows(x_BSHD, start_or_index, length, *, absolute=False):
    """Rows ``start + i`` (or the given absolute indices) of each batch row, clamped in range."""
    B, _, H, D = x_BSHD.shape
    index_BS = start_or_index if absolute else (start_or_index[:, None] + torch.arange(length, device=x_BSHD.device)).clamp_max(x_BSHD.shape[1] - 1)
    return x_BSHD.gather(1, index_BS[:, :, None, None].expand(B, index_BS.shape[1], H, D))


def _packed(query, key, value, cu_q, cu_k, max_q, max_k, *, window, scale, causal, sinks):
    B, H, S, _ = query.shape
    q_THD = query.transpose(1, 2).reshape(-1, H, query.shape[-1])
    k_THD = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[-1])
    v_THD = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1])
    out_THD = varlen_attention(q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, scale=scale, causal=causal, window_size=window, sinks=sinks)
    return out_THD.view(B, S, H, -1)


def _packing_from_position_ids(position_ids, batch: int, q_len: int, kv_len: int):
    """((cu_q, cu_k), (max_q, max_k)) when ``position_ids`` restart inside a single row, else None.

    Reading the document boundaries needs the host, so the answer is kept on the tensor itself:
    every layer of one forward shares the same ``position_ids`` object and pays once.
    """
    if position_ids is None or batch != 1 or q_len != kv_len or q_len < 2:
        return None
    cached = getattr(position_ids, "_cudnn_attention_packing", None)
    if cached is not None and cached[0] == position_ids._version:
        return cached[1]
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    packing = None
    if bool(_is_packed_sequence(position_ids, batch)):
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
        packing = ((cu_q, cu_k), (int(max_q), int(max_k)))
    position_ids._cudnn_attention_packing = (position_ids._version, packing)
    return packing


def _eager(module, query, key, value, attention_mask, reason, *, is_causal, sliding_window, scaling, dropout, softcap, **kwargs):
    """Count, warn once (or raise in strict mode), then run the model's eager attention on a mask
    that carries everything the fast path would have applied."""
    note_fallback("forward", f"transformers: {reason}")
    B, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4:
        keep_4d = attention_mask
    else:
        doc_ids_T = None
        if attention_mask is None:  # packed documents are kept apart by their ids (a 2D mask means no packing)
            cu = kwargs.get("cu_seq_lens_k")
            if cu is None:
                packing = _packing_from_position_ids(kwargs.get("position_ids"), B, q_len, kv_len)
                cu = None if packing is None else packing[0][1]
            if cu is not None:
                doc_ids_T = torch.searchsorted(cu[1:].long(), torch.arange(kv_len, device=query.device), right=True)
        keep_4d = keep_mask_4d(batch=B, q_len=q_len, kv_len=kv_len, device=query.device, causal=is_causal, sliding_window=sliding_window,
                               keep_BK=attention_mask, doc_ids_T=doc_ids_T)  # fmt: skip
    if softcap is not None:
        kwargs["softcap"] = softcap
    needs_grad = _needs_grad(query, key, value, kwargs.get("s_aux"))
    out, weights = eager_equivalent(module, query, key, value, keep_4d, scaling=scaling, dropout=dropout, **kwargs)
    return fallback_output(out, f"transformers: {reason}", needs_grad=needs_grad), weights
