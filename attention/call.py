"""One value for a prepared call: what the layers below the public API need to know about it.

The public functions (and the SDPA provider) validate their arguments once and build an
:class:`AttentionCall`; it then travels unchanged to the graph cache (it is part of the key), the
kernels and the backward, instead of a dozen loose scalars each layer would take apart and rebuild.
"""

from __future__ import annotations

from typing import NamedTuple

from .masking import MaskSpec

__all__ = ["AttentionCall"]


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
