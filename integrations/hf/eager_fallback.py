"""The exact eager-equivalent path for what cuDNN cannot express (softcap, attention dropout,
additive position biases, returned attention weights, custom 4-D masks).

It calls the model's own ``eager_attention_forward`` (so gpt-oss sinks, Gemma 2 softcapping and
the like keep their exact semantics) with an additive 4-D mask built from everything the fast
path would have applied: causality, the sliding window, padding, and document boundaries of
packed batches.
"""

from __future__ import annotations

import sys

import torch

from .mask_function import pad_keys, query_positions

__all__ = ["eager_equivalent", "keep_mask_4d"]


def keep_mask_4d(
    *,
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    causal: bool,
    sliding_window: int | None,
    keep_BK: torch.Tensor | None = None,
    doc_ids_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool (B, 1, q_len, kv_len). Queries sit at the last ``q_len`` key positions, or, with a
    keep-mask (B, W written keys; see mask_function), at the last ``q_len`` of its ``W`` columns.
    Causality and the window count absolute key positions, as transformers' eager mask does, so a
    mask with a gap (padding between real tokens) gets eager's exact semantics."""
    written = kv_len
    if keep_BK is not None:
        keep_BK, written = pad_keys(keep_BK, kv_len)
    i_Q1 = query_positions(written, q_len, device).view(q_len, 1)
    j_1K = torch.arange(kv_len, device=device).view(1, kv_len)
    allowed_QK = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        allowed_QK &= j_1K <= i_Q1
    if sliding_window is not None:
        # transformers: W keys including self when causal; |i - j| <= W when bidirectional.
        allowed_QK &= (j_1K > i_Q1 - sliding_window) if causal else ((i_Q1 - j_1K).abs() <= sliding_window)
    allowed_BQK = allowed_QK.expand(batch, q_len, kv_len)
    if keep_BK is not None:
        allowed_BQK = allowed_BQK & keep_BK[:, None, :]
    if doc_ids_T is not None:
        allowed_BQK = allowed_BQK & (doc_ids_T[-q_len:, None] == doc_ids_T[None, :])
    return allowed_BQK[:, None]


def eager_equivalent(module, query, key, value, keep_4d: torch.Tensor, *, scaling, dropout, **kwargs):
    """Run the model's own eager attention with ``keep_4d`` as its additive mask."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"cudnn attention cannot express this call and {type(module).__module__} has no eager_attention_forward to fall back on"
        )
    if keep_4d.dtype == torch.bool:
        additive = torch.zeros(keep_4d.shape, dtype=query.dtype, device=query.device)
        keep_4d = additive.masked_fill(~keep_4d, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, keep_4d, scaling=scaling, dropout=dropout, **kwargs)
