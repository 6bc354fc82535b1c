"""The attention function behind ``attn_implementation="cudnn"``.

Contract (transformers 5.x): ``fn(module, query, key, value, attention_mask, dropout=, scaling=,
**kwargs) -> (out (B, S_q, H_q, D_v), None)`` with query/key/value (B, H, S, D) transposed views of
(B, S, H, D) and K/V heads not repeated. An ordered ladder, like FlashAttention's:

1. what cuDNN cannot express -> the model's exact eager path, counted and warned (strict: raises);
2. a 2-D keep-mask (B, W written keys) or a static cache's slot map (see mask_function) -> each row's kept tokens gathered to the
   front in order (any 0/1 pattern: left, right, trailing-everywhere, gaps), the padded cuDNN path
   (padding is never computed), and gathered back. Causality stays exact under this compaction
   (order is kept); a sliding window counted in compact positions equals transformers' (absolute
   positions) unless a row has a gap, see ``_masked``;
3. ``cu_seq_lens_q/k`` + ``max_length_q/k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)
   -> the packed path; the metadata is checked (CPU: on the host, CUDA: on the device, no sync);
4. packing detected from ``position_ids`` (batch 1, a position that does not follow its
   predecessor starts a document, as in transformers' eager mask) -> the packed path (finding the
   documents reads them on the host, once per forward);
5. dense, causal per transformers' resolution, bottom-right aligned when decoding from a cache.

Inside ``cudnn_attention.context_parallel.over(group)`` the tensors are this rank's zigzag shard of each sequence and
``_context_parallel`` serves them instead (no eager fallback exists for a sharded sequence: what cuDNN's path cannot
express there is refused, before any collective).
"""

from __future__ import annotations

import torch

from ... import context_parallel, dtypes, tensor_memo
from ...api import attention, varlen_attention
from ...call import needs_grad as _needs_grad
from ...packed_batch import packed_batch
from ...policy import fallback_in_graph, fallback_output, note_fallback
from .eager_fallback import eager_equivalent, keep_mask_4d
from .mask_function import check_padding_mask, is_tracing, pad_keys, query_positions

__all__ = ["cudnn_attention_forward"]

_HALF = dtypes.cudnn_dtypes()  # what mixed autocast inputs are cast to


def cudnn_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:  # an explicit kwarg wins over the module (encoders, cross-attention)
        is_causal = getattr(module, "is_causal", True)
    # transformers reads it by its truth (a config's is_decoder, say); the core takes a bool only.
    is_causal = bool(is_causal)
    sinks = kwargs.get("s_aux")
    query, key, value = _to_compute_dtype(query, key, value)
    if context_parallel.active() is not None:
        return _context_parallel(
            query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, is_causal, sinks, kwargs
        ), None
    B, H, q_len, _ = query.shape
    kv_len = key.shape[2]
    if attention_mask is not None:
        _check_mask(attention_mask, batch=B, heads=H, q_len=q_len, kv_len=kv_len, causal=is_causal)
    user_packing = None if attention_mask is not None else _user_packing(kwargs, B * q_len, B * kv_len, query.device)

    reason = _inexpressible(attention_mask, dropout, softcap, kwargs)
    if reason is not None:
        return _eager(
            module,
            query,
            key,
            value,
            attention_mask,
            reason,
            is_causal=is_causal,
            sliding_window=sliding_window,
            scaling=scaling,
            dropout=dropout,
            softcap=softcap,
            **kwargs,
        )

    options = dict(scale=scaling, causal=is_causal, sinks=sinks)
    if attention_mask is not None:
        if (
            sliding_window is not None
            and q_len > 1
            and _window(sliding_window, is_causal, kv_len) != (-1, -1)
            and _may_have_gap(attention_mask)
        ):
            return _eager(
                module,
                query,
                key,
                value,
                attention_mask,
                "a sliding window over a padding mask with a gap",
                is_causal=is_causal,
                sliding_window=sliding_window,
                scaling=scaling,
                dropout=dropout,
                softcap=softcap,
                **kwargs,
            )
        return _masked(query, key, value, attention_mask, sliding_window=sliding_window, **options), None

    if user_packing is not None:
        cu_q, cu_k, max_q, max_k = user_packing
        return _packed(query, key, value, cu_q, cu_k, max_q, max_k, window=_window(sliding_window, is_causal, max_k), **options), None

    packing = _packing_from_position_ids(kwargs.get("position_ids"), B, q_len, kv_len)
    if packing is not None:
        (cu_q, cu_k), (max_q, max_k) = packing
        return _packed(query, key, value, cu_q, cu_k, max_q, max_k, window=_window(sliding_window, is_causal, max_k), **options), None

    out = attention(query, key, value, bottom_right=q_len != kv_len, window_size=_window(sliding_window, is_causal, kv_len), **options)
    return out.transpose(1, 2), None


def _context_parallel(query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, is_causal, sinks, kwargs):
    """(B, S/N, H, D_v) under context parallelism: the whole row's documents from ``cu_seq_lens_*`` (one packed row, as
    ``shard_batch_for_context_parallel`` gives it), else every row one dense sequence."""
    reason = _inexpressible(attention_mask, dropout, softcap, kwargs)
    if reason is None and attention_mask is not None:
        reason = "a padding attention_mask (shard_batch_for_context_parallel packs the kept tokens instead)"
    B, _, q_len, _ = query.shape
    if reason is None and q_len != key.shape[2]:
        reason = f"a KV cache ({q_len} queries, {key.shape[2]} keys)"
    if reason is not None:
        raise ValueError(f"context parallelism: attn_implementation='cudnn' cannot serve {reason} on sharded sequences")
    options = dict(scale=scaling, causal=is_causal, sinks=sinks)
    cu_q, cu_k, max_q, max_k = (kwargs.get(name) for name in _FLASH_KWARGS)
    if cu_q is not None or cu_k is not None:
        if B != 1 or cu_k is None or max_q is None or max_k is None:
            raise ValueError(
                "context parallelism: cu_seq_lens_q/k describe one packed row and come with max_length_q/k "
                f"(shard_batch_for_context_parallel gives them); got a batch of {B} rows"
            )
        return _packed(
            query, key, value, cu_q, cu_k, int(max_q), int(max_k), window=_window(sliding_window, is_causal, int(max_k)), **options
        )
    _check_sharded_positions(kwargs.get("position_ids"), q_len)
    S = q_len * context_parallel.active().world_size
    return attention(query, key, value, window_size=_window(sliding_window, is_causal, S), **options).transpose(1, 2)


def _check_sharded_positions(position_ids, q_len: int) -> None:
    """Without ``cu_seq_lens_*`` each row is one sequence, so its positions must be this rank's zigzag share of 0..S-1:
    packed ``position_ids`` would otherwise be served as one sequence (its documents cannot be found in a shard). Read on
    the host once per ``position_ids`` tensor (every layer of a forward shares it)."""
    if position_ids is None or tensor_memo.recall(position_ids, "context-parallel positions") is not None:
        return
    active = context_parallel.active()
    expected = context_parallel.shard_positions(q_len * active.world_size, active.world_size, active.rank).to(position_ids.device)
    if not bool((position_ids.reshape(-1, q_len) == expected).all()):
        raise ValueError(
            "context parallelism: position_ids are not this rank's share of one sequence per row (packed documents?): pass "
            "the batch through shard_batch_for_context_parallel, which gives the whole row's cu_seq_lens_q/k"
        )
    tensor_memo.remember(position_ids, "context-parallel positions", True)


def _check_mask(attention_mask, *, batch: int, heads: int, q_len: int, kv_len: int, causal: bool) -> None:
    """The mask's shape against the queries and keys, on the host before anything runs. A 4-D mask goes to the
    model's eager attention as it is, where a wrong shape broke only after the scores were computed, and an
    integer keep-mask was added to them (+1 where kept: nothing masked). A causal layer's 2-D mask holds the
    queries as its last columns (see mask_function), so it cannot be narrower than them."""
    if attention_mask.dim() != 4:
        check_padding_mask(attention_mask, batch)
        if causal and attention_mask.shape[1] < q_len:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} columns (keys), fewer than the {q_len} new tokens: a 2-D "
                "attention_mask needs one column per key, past and current, the new tokens' own included"
            )
        return
    if attention_mask.dtype != torch.bool and not attention_mask.is_floating_point():
        raise TypeError(f"a 4-D attention_mask must be bool (True attends) or floating (added to the scores), got {attention_mask.dtype}")
    b, h, q, k = attention_mask.shape
    if b not in (1, batch) or h not in (1, heads) or q not in (1, q_len) or k != kv_len:
        raise ValueError(
            f"a 4-D attention_mask must have shape (1 or {batch}, 1 or {heads}, 1 or {q_len}, {kv_len}) for these queries "
            f"and keys, got {tuple(attention_mask.shape)}"
        )


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


def _masked(query, key, value, mask_BW, *, sliding_window, scale, causal, sinks):
    """A 2-D keep-mask (B, W written keys): the compacted padded path for the queries. Without
    gradients (generation) the last query row is also computed on its own (see ``_last_query``),
    so that a padded last position, the one generate reads after a right-padded prompt, gets
    eager's output rather than zero. Training skips that second call: a padded position's output
    feeds no loss (its label is ignored), and FlashAttention's zero is as good there."""
    q_len, kv_len = query.shape[2], key.shape[2]
    keep_BK, written = pad_keys(mask_BW, kv_len)
    window = _window(sliding_window, causal, kv_len)
    reach = None if window == (-1, -1) else (sliding_window if causal else sliding_window + 1)
    if q_len == 1:
        return _last_query(query, key, value, keep_BK, written, reach, scale=scale, sinks=sinks)
    out_BQHD, compact_kv = _padded(query, key, value, keep_BK, written, window=window, scale=scale, causal=causal, sinks=sinks)
    if _needs_grad(query, key, value, sinks):
        return out_BQHD
    last_B1HD = _last_query(query[:, :, -1:], key, value, keep_BK, written, reach, scale=scale, sinks=sinks, compact_kv=compact_kv)
    kept_last_B111 = keep_BK[:, written - 1].view(-1, 1, 1, 1)
    return torch.cat([out_BQHD[:, :-1], torch.where(kept_last_B111, out_BQHD[:, -1:], last_B1HD)], dim=1)


def _last_query(query_BH1D, key, value, keep_BK, written, reach, *, scale, sinks, compact_kv=None):
    """(B, 1, H, D_v): the query at key position ``written - 1`` as transformers' eager attention
    computes it, kept or padding: it sees the kept keys among the last ``reach`` positions (its
    window, in absolute positions, so gaps are exact), or all kept keys. One query's window is a
    set of keys, so no band is needed: those keys are compacted and attended without a mask.
    ``compact_kv``: (k, v, lengths) of every kept key, already gathered by the caller. A padded
    query with no kept key in its window reads zero, where eager's additive mask averages every
    value of the cache: generate reads that row when a right-padded prompt ends with more padding
    than the window (documented in the README as the one difference from eager)."""
    if reach is not None:
        if isinstance(written, torch.Tensor):
            # A static cache's slot map: a slice bounded by a tensor would give a shape that changes every step, so
            # the window masks the whole cache instead (its unwritten slots are not kept already).
            keep_BK = keep_BK & (torch.arange(keep_BK.shape[-1], device=keep_BK.device) >= written - reach)
        else:
            first = torch.sym_max(written - reach, 0)
            keep_BK, key, value = keep_BK[:, first:written], key[:, :, first:written], value[:, :, first:written]
        compact_kv = None
    if compact_kv is None:
        order_kv_BK, len_kv_B = _compaction(keep_BK)
        compact_kv = (_gather_tokens(key, order_kv_BK), _gather_tokens(value, order_kv_BK), len_kv_B)
    k_c, v_c, len_kv_B = compact_kv
    out = attention(query_BH1D, k_c, v_c, scale=scale, sinks=sinks, seqlens_kv=len_kv_B)
    return out.transpose(1, 2)


def _may_have_gap(mask_BW) -> bool:
    """Whether some row's kept tokens are not one unbroken run (padding between real tokens, e.g.
    generate continuing a right-padded prompt). Then a window counted over the compacted tokens
    would differ from transformers' absolute-position window, so the caller takes the exact eager
    path. The answer is read on the host once per mask object (every sliding layer of a forward
    shares it) and kept on the tensor; while tracing nothing can be read, and the exact path is taken."""
    if is_tracing():
        return True
    cached = tensor_memo.recall(mask_BW, "has a gap")
    if cached is not None:
        return cached
    keep_BW, _ = pad_keys(mask_BW, mask_BW.shape[-1])  # a slot map's unwritten slots are not kept: no gap
    count_B = keep_BW.sum(dim=-1)
    first_B = keep_BW.to(torch.int8).argmax(dim=-1)
    last_B = keep_BW.shape[-1] - 1 - keep_BW.flip(-1).to(torch.int8).argmax(dim=-1)
    gap = bool(((count_B > 0) & (last_B - first_B + 1 != count_B)).any())
    tensor_memo.remember(mask_BW, "has a gap", gap)
    return gap


def _padded(query, key, value, keep_BK, written, *, window, scale, causal, sinks):
    """(out (B, Q, H, D_v), (k, v, lengths) compacted). Each row's kept tokens are gathered to the
    front in order (a stable sort of the keep-mask on the device, FlashAttention's unpadding kept
    per row), served by the padded cuDNN path with per-row lengths, and gathered back; padded
    query rows read zero (FlashAttention's convention; ``_masked`` redoes the last one). The queries are the last
    ``q_len`` of the ``written`` keys, so the k-th kept query is the last kept key but
    ``len_q - 1 - k``: the diagonal is bottom-right aligned per row."""
    q_len = query.shape[2]
    keep_BQ = keep_BK.index_select(1, query_positions(written, q_len, query.device))
    order_q_BQ, len_q_B = _compaction(keep_BQ)
    order_kv_BK, len_kv_B = _compaction(keep_BK)
    q_c = _gather_tokens(query, order_q_BQ)
    k_c = _gather_tokens(key, order_kv_BK)
    v_c = _gather_tokens(value, order_kv_BK)
    out_c = attention(
        q_c,
        k_c,
        v_c,
        scale=scale,
        causal=causal,
        bottom_right=True,
        window_size=window,
        sinks=sinks,
        seqlens_q=len_q_B,
        seqlens_kv=len_kv_B,
    )
    # Back to original positions: a kept query is compact row (kept queries before it), others zero.
    rank_BQ = (keep_BQ.cumsum(dim=1) - 1).clamp_min(0)
    out_BQHD = _gather_tokens(out_c, rank_BQ).transpose(1, 2)
    return out_BQHD * keep_BQ[:, :, None, None].to(out_BQHD.dtype), (k_c, v_c, len_kv_B)


def _compaction(keep_BL):
    """(order, count): indices that bring each row's kept tokens to the front, in order, and how many there are."""
    order_BL = torch.argsort((~keep_BL).to(torch.uint8), dim=1, stable=True)
    return order_BL, keep_BL.sum(dim=1, dtype=torch.int32)


def _gather_tokens(x_BHSD, index_BL):
    """(B, H, L, D) view of tokens ``index_BL`` of each row, gathered token-major (B, L, H, D) so the
    core reads it without a copy."""
    x_BSHD = x_BHSD.transpose(1, 2)
    B, _, H, D = x_BSHD.shape
    return x_BSHD.gather(1, index_BL[:, :, None, None].expand(B, index_BL.shape[1], H, D)).transpose(1, 2)


def _packed(query, key, value, cu_q, cu_k, max_q, max_k, *, window, scale, causal, sinks):
    B, H, S, _ = query.shape
    q_THD = query.transpose(1, 2).reshape(-1, H, query.shape[-1])
    k_THD = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[-1])
    v_THD = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1])
    out_THD = varlen_attention(q_THD, k_THD, v_THD, cu_q, cu_k, max_q, max_k, scale=scale, causal=causal, window_size=window, sinks=sinks)
    return out_THD.view(B, S, H, -1)


_FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _user_packing(kwargs, tokens_q: int, tokens_k: int, device):
    """(cu_q, cu_k, max_q, max_k) from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``'s
    kwargs, checked (every path that reads them, the eager fallback included), or None.

    The four come together: with some missing, which document each token belongs to would be a guess (flash
    silently ignores them all, and documents then attend to each other unless position_ids say otherwise).
    Their shapes, dtypes, device and the maxima (non-negative upper bounds; one above the token count is used as
    the token count) are checked on the host like the core's, named as transformers names them. In a
    transformers batch every token is real, so the prefix sums must cover all of them (one past ``cu[-1]``
    would get a zero output), and ``max_length`` must bound every document (a longer one would be cut
    short): the core's check, CPU on the host with a ValueError naming the argument, CUDA on the device
    without a sync."""
    cu_q, cu_k, max_q, max_k = (kwargs.get(name) for name in _FLASH_KWARGS)
    if cu_q is None and cu_k is None and max_q is None and max_k is None:
        return None
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        missing = ", ".join(name for name, value in zip(_FLASH_KWARGS, (cu_q, cu_k, max_q, max_k)) if value is None)
        raise ValueError(
            f"cu_seq_lens_q, cu_seq_lens_k, max_length_q and max_length_k go together (DataCollatorWithFlattening("
            f"return_flash_attn_kwargs=True) gives all four), got them without {missing}"
        )
    max_q, max_k = int(max_q), int(max_k)
    # The batch is built (and checked) once: the core's calls of every layer find it again.
    packed_batch(cu_q, cu_k, max_q, max_k, tokens_q=tokens_q, tokens_kv=tokens_k, device=device, cover_all=True, names=_FLASH_KWARGS)
    return cu_q, cu_k, max_q, max_k


def _packing_from_position_ids(position_ids, batch: int, q_len: int, kv_len: int):
    """((cu_q, cu_k), (max_q, max_k)) when ``position_ids`` hold more than one document in a single
    row, else None.

    Documents are found as transformers' eager mask finds them (``find_packed_sequence_indices``):
    one starts at the first token and wherever a position is not its predecessor's plus one. So
    every token lies in a document: ``[3, 4, 5, 0, 1, 2]`` is two documents, the first a
    continuation. (FlashAttention's rule, a document starts where the position equals the row's
    minimum, leaves tokens before the first minimum in no document, with a zero output.)

    Reading the document boundaries needs the host, so the answer is kept on the tensor itself:
    every layer of one forward shares the same ``position_ids`` object and pays once.
    """
    if position_ids is None or batch != 1 or q_len != kv_len or q_len < 2:
        return None
    cached = tensor_memo.recall(position_ids, "packing")
    if cached is not None:
        return cached[0]
    position_T = position_ids.reshape(-1)
    starts_T = torch.ones_like(position_T, dtype=torch.bool)
    starts_T[1:] = position_T[1:] != position_T[:-1] + 1
    bounds = starts_T.nonzero().view(-1).tolist() + [position_T.numel()]  # the one host read
    packing = None
    if len(bounds) > 2:
        cu = torch.tensor(bounds, dtype=torch.int32, device=position_ids.device)
        longest = max(end - start for start, end in zip(bounds, bounds[1:]))
        # Built to cover every token: the check proves it to the core's batch (the kernels need no fill) at no host cost.
        packed_batch(cu, cu, longest, longest, tokens_q=position_T.numel(), tokens_kv=position_T.numel(), cover_all=True)
        packing = ((cu, cu), (longest, longest))
    tensor_memo.remember(position_ids, "packing", (packing,))  # wrapped: None (no packing) is an answer too
    return packing


def _eager(module, query, key, value, attention_mask, reason, *, is_causal, sliding_window, scaling, dropout, softcap, **kwargs):
    """Count, warn once (or raise in strict mode), then run the model's eager attention on a mask
    that carries everything the fast path would have applied. Under ``torch.compile`` the graph does
    that bookkeeping each time it runs (:func:`~cudnn_attention.policy.fallback_in_graph`); under
    TorchScript or fx tracing nothing is counted (a Python side effect their graphs would not replay;
    strict mode cannot refuse it either)."""
    compiling = torch.compiler.is_compiling()
    if not is_tracing():
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
        keep_4d = keep_mask_4d(
            batch=B,
            q_len=q_len,
            kv_len=kv_len,
            device=query.device,
            causal=is_causal,
            sliding_window=sliding_window,
            keep_BK=attention_mask,
            doc_ids_T=doc_ids_T,
        )
    if softcap is not None:
        kwargs["softcap"] = softcap
    needs_grad = _needs_grad(query, key, value, kwargs.get("s_aux"))
    out, weights = eager_equivalent(module, query, key, value, keep_4d, scaling=scaling, dropout=dropout, **kwargs)
    if compiling:
        return fallback_in_graph(out, f"transformers: {reason}"), weights
    if is_tracing():
        return out, weights
    return fallback_output(out, f"transformers: {reason}", needs_grad=needs_grad), weights
