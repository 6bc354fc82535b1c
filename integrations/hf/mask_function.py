"""The mask side of ``attn_implementation="cudnn"``: what transformers hands the attention function.

transformers builds one mask per forward through the function registered under the
implementation's name (a name registered only for attention gets ``attention_mask=None`` always,
silently dropping padding). This one returns, like FlashAttention's:

- ``None`` when every key is written and none is padding (the attention function applies
  causality and windows; queries are the last ``q_len`` keys);
- a 2-D bool keep-mask (B, W) whose width W is the number of *written* keys: keys past W are
  slots of a cache nobody wrote yet, and the queries are keys ``W - q_len .. W - 1``.
  Zeros inside the mask are padding, wherever they are (left, right, or a gap), never unwritten
  slots: the width alone says where the queries sit, so a batch whose every row ends with padding
  (``pad_to_multiple_of``, ``padding="max_length"``) is not mistaken for a static cache.
  transformers' FlashAttention path uses the same convention (``_upad_input`` slices K/V to the
  mask's width);
- for a static cache's full-attention layers (transformers hands their written length over as a
  tensor, ``q_offset``), a slot map: an int8 (B, K) tensor over every slot of the cache, 1 for a key to
  attend, 0 for padding, -1 for a slot not written yet (:data:`UNWRITTEN`). Its shape is the cache's, the same
  at every decode step, so a forward compiled with ``dynamic=False`` sees the same input each step and replays
  one graph (a mask as wide as the written keys grew by a column per step and recompiled it every time), and
  reading it needs no host read of the written length. A 2-D mask of any other dtype is a keep-mask;
- a 4-D bool mask from transformers' own ``sdpa_mask`` when a model adds its own mask functions
  (``or``/``and`` overlays): cuDNN cannot express those, and the attention function then runs the
  exact eager-equivalent path on that mask.

A 2-D mask that cannot be the input's (a row count other than the batch's, or, in a causal layer, fewer columns
than the keys seen so far) raises a ValueError naming both sizes before anything is computed; see
``_check_covers_seen_keys`` for what a narrower mask legitimately is.

The function is traceable (``torch.compile(fullgraph=True)``): no data-dependent Python branch runs
while tracing. Outside tracing it reads one thing on the host, once per forward, as transformers'
sdpa and flash mask builders do: whether a padding mask is all ones (then ``None``).

Under ``generate`` with a static cache, transformers calls this function twice per step: once in
``prepare_inputs_for_generation`` (outside a compiled forward) and again inside the forward with
the first result as ``attention_mask``, cast to bool on the way in. The slot map does not survive that cast
(-1 becomes True), and need not: the second call rebuilds it from the same written length.
"""

from __future__ import annotations

import torch

from ... import _compat

__all__ = ["UNWRITTEN", "check_padding_mask", "cudnn_attention_mask", "is_tracing", "pad_keys", "query_positions", "static_cache_slots"]

# A slot map's value for a static cache slot not written yet (see the module docstring); its dtype marks the map.
UNWRITTEN = -1
_SLOT_MAP_DTYPE = torch.int8


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
    if attention_mask is not None:
        check_padding_mask(attention_mask, batch_size)
        # transformers' bidirectional masks (encoders, cross-attention, drafters) are the calls that pass this; their
        # masks may legitimately cover other keys than the queries' past (the encoder's, or only the accepted tokens).
        if "allow_is_bidirectional_skip" not in kwargs:
            _check_covers_seen_keys(attention_mask.shape[-1], q_offset=q_offset, q_length=q_length, kv_length=kv_length)
    if kwargs.get("use_vmap"):
        # Custom overlays (e.g. bidirectional image tokens) only transformers can evaluate.
        return _sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, use_vmap=True, **kwargs)
    written = q_offset + q_length - kv_offset  # keys past this are cache slots nobody wrote yet
    if isinstance(written, torch.Tensor):
        # A static cache's full-attention layer keeps its length in a tensor (so compiled graphs do not depend on it).
        return static_cache_slots(attention_mask, batch_size=batch_size, kv_length=kv_length, written=written)
    if attention_mask is not None:
        # Its width is the keys seen so far (transformers' contract: past + q_length). Sliding layers keep only their
        # last kv_length keys.
        keep_BW = attention_mask[:, -kv_length:].bool()
        if not is_tracing() and keep_BW.shape[-1] == kv_length and bool(keep_BW.all()):
            return None  # nothing to mask: the faster dense path (one host read per forward, like sdpa/flash)
        return keep_BW
    if written >= kv_length:
        return None
    return torch.ones(batch_size, written, dtype=torch.bool, device=kwargs.get("device"))


def static_cache_slots(attention_mask: torch.Tensor | None, *, batch_size: int, kv_length: int, written: torch.Tensor) -> torch.Tensor:
    """The slot map (B, ``kv_length``) int8 of a static cache holding ``written`` keys (a tensor): each written slot
    1 where ``attention_mask`` (a 2-D keep-mask of the written keys, or None: no padding) keeps it, else 0; every
    later slot :data:`UNWRITTEN`. Columns of a mask narrower than ``written`` are not attended."""
    slot_K = torch.arange(kv_length, device=written.device)
    if attention_mask is None:
        keep_BK = torch.ones(batch_size, kv_length, dtype=torch.bool, device=written.device)
    else:
        keep_BW = attention_mask[:, -kv_length:].bool()
        keep_BK = torch.nn.functional.pad(keep_BW, (0, kv_length - keep_BW.shape[-1]))
    return torch.where(slot_K < written, keep_BK.to(_SLOT_MAP_DTYPE), UNWRITTEN)


def check_padding_mask(attention_mask: torch.Tensor, batch_size: int) -> None:
    """A 2-D padding mask has one row per sequence. (transformers passes a 4-D mask to the attention function as
    it is, without calling this function, and any other rank would be sliced here as if it were 2-D.)"""
    if attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape)
        raise ValueError(f"attention_mask must be 2-D (batch, keys) or 4-D (batch, heads, queries, keys), got shape {shape}")
    if attention_mask.shape[0] != batch_size:
        raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows for a batch of {batch_size}")


def _check_covers_seen_keys(width: int, *, q_offset, q_length: int, kv_length: int) -> None:
    """A causal layer's 2-D mask has one column per key seen so far: ``q_offset`` cached plus ``q_length`` new
    (transformers' contract). A narrower one would be read as a static cache's written keys, with the queries as its
    last columns: an out-of-bounds gather when it is narrower than the queries, else keys silently dropped. The
    mask this function returned for a sliding layer comes back (generate with a static cache) exactly
    ``kv_length`` wide; a static cache's offset is a tensor on the device, and is not read for this (the
    attention function checks that the queries fit)."""
    if isinstance(q_offset, torch.Tensor) or width == kv_length:
        return
    seen = q_offset + q_length
    if width < seen:
        raise ValueError(
            f"attention_mask has {width} columns, but the keys number {seen} ({q_offset} cached + {q_length} new): "
            "a 2-D attention_mask needs one column per key, past and current"
        )


def _sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, *, use_vmap, **kwargs):
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function or causal_mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        use_vmap=use_vmap,
        device=kwargs.get("device"),
    )


def is_tracing() -> bool:
    """Whether a graph is being traced (dynamo, TorchScript, fx): no host reads or data-dependent branches then."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing() or _compat.fx_symbolic_tracing()


def pad_keys(mask_BW: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, int | torch.Tensor]:
    """``(keep_BK, written)``: the keys to attend (B, ``kv_len``) bool, and how many of the cache's slots are written
    (the queries are the last of them). From a keep-mask (B, W written keys): widened to ``kv_len`` keys, a static
    cache's unwritten slots not kept, and W (a mask wider than the keys keeps its last ``kv_len`` columns, as
    transformers slices it for sliding layers). From a slot map: the slots it marks 1, and the written count as a
    0-d tensor, which nothing reads on the host."""
    if mask_BW.dtype == _SLOT_MAP_DTYPE and mask_BW.shape[-1] == kv_len:
        return mask_BW > 0, (mask_BW[:1] != UNWRITTEN).sum()  # every row of a slot map has the same written slots
    keep_BW = mask_BW[:, -kv_len:].bool()
    written = keep_BW.shape[-1]
    return torch.nn.functional.pad(keep_BW, (0, kv_len - written), value=False), written


def query_positions(written, q_len: int, device) -> torch.Tensor:
    """Key positions (q_len,) of the queries: the last ``q_len`` of the ``written`` keys (an int, or a 0-d tensor from
    a slot map; a KV cache, static or not, appends the queries' own keys before attention runs)."""
    return torch.arange(q_len, device=device) + (written - q_len)
