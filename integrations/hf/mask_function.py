"""The mask side of ``attn_implementation="cudnn"``: what transformers hands the attention function.

transformers builds one mask per forward through the function registered under the
implementation's name (a name registered only for attention gets ``attention_mask=None`` always,
silently dropping padding). This one returns, like FlashAttention's:

- ``None`` when no key needs masking (the attention function applies causality and windows);
- a 2-D bool keep-mask (B, kv_length) when keys are padding or are cache slots not yet written
  (a static cache hands over its full length; keys at or past ``q_offset + q_length`` are unwritten);
- a 4-D bool mask from transformers' own ``sdpa_mask`` when a model adds its own mask functions
  (``or``/``and`` overlays): cuDNN cannot express those, and the attention function then runs the
  exact eager-equivalent path on that mask, visibly.
"""

from __future__ import annotations

import torch

__all__ = ["cudnn_attention_mask", "pad_keys", "query_positions"]


def cudnn_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    if kwargs.get("use_vmap"):
        # Custom overlays (e.g. bidirectional image tokens) only transformers can evaluate.
        return sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False, use_vmap=True,
            device=kwargs.get("device"),
        )  # fmt: skip
    keep_BK = flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
    written = q_offset + q_length - kv_offset  # keys past this are cache slots nobody wrote yet
    if isinstance(written, torch.Tensor) or written < kv_length:
        device = kwargs.get("device") or (attention_mask.device if attention_mask is not None else None)
        written_BK = (torch.arange(kv_length, device=device) < written).expand(batch_size, kv_length)
        if keep_BK is None:
            return written_BK
        return pad_keys(keep_BK, kv_length) & written_BK
    return keep_BK


def pad_keys(keep_BK: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``keep_BK`` widened to ``kv_len`` keys: a static cache's unwritten tail, past the 2D mask, is not kept."""
    if keep_BK.shape[-1] >= kv_len:
        return keep_BK
    return torch.nn.functional.pad(keep_BK, (0, kv_len - keep_BK.shape[-1]), value=False)


def query_positions(keep_BK, q_len: int) -> torch.Tensor:
    """Key positions of the ``q_len`` queries: the last ones written. A static cache hands over
    slots past them, which the mask marks unkept in every row; computed on the device."""
    kv_len = keep_BK.shape[-1]
    written_from_end = keep_BK.any(dim=0).flip(0).to(torch.int32).argmax()
    return (kv_len - written_from_end - q_len + torch.arange(q_len, device=keep_BK.device)).clamp_min(0)
