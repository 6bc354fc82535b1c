"""One value for a prepared call: what the layers below the public API need to know about it.

The public functions (and the SDPA provider) validate their arguments once and build an
:class:`AttentionCall`; it then travels unchanged to the graph cache (it is part of the key), the
kernels and the backward, instead of a dozen loose scalars each layer would take apart and rebuild.
Its per-call index tensors travel beside it as one :class:`Lengths`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .masking import MaskSpec

__all__ = ["NO_LENGTHS", "AttentionCall", "Lengths"]


class AttentionCall(NamedTuple):
    """A validated call's options (everything but the tensors).

    ``max_seqlen_*`` are the dense sequence lengths (S_q, S_kv) or the packed documents' bounds;
    ``scale`` is already positive (see :func:`cudnn_attention.validation.positive_scale`).
    """

    packed: bool
    padded: bool
    documents: int  # packed: len(cu_seqlens) - 1; dense: 0
    max_seqlen_q: int
    max_seqlen_kv: int
    scale: float
    mask: MaskSpec
    has_sinks: bool
    need_lse: bool  # the caller wants the LSE, or the backward will need it
    needs_grad: bool


class Lengths(NamedTuple):
    """A call's index tensors, as the kernels take them: a padded dense call's per-row lengths
    (int32 (B,), already clamped, see :func:`cudnn_attention.masking.effective_lengths`), or a
    packed call's prefix sums; None where the call has none."""

    seqlens_q: torch.Tensor | None = None
    seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None


NO_LENGTHS = Lengths()
