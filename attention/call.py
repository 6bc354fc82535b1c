"""One value for a call, from the public API to the launch: :class:`AttentionCall` (the options), :class:`Lengths` (its
index tensors: a padded batch's lengths or a packed batch) and :class:`Prepared` (both, with q/k/v/sinks as the
kernels take them). The value is made once per call (:mod:`cudnn_attention.prepare`) and travels unchanged to the
plan, the graph cache (it is part of every key, :mod:`cudnn_attention.call_keys`) and the kernels; the ops' flat form
of it is :mod:`cudnn_attention.op_args`.

Legend: B batch, H heads, S sequence, D head dim, T packed tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .masking import MaskSpec, effective_lengths
from .packed_batch import PackedBatch, registered_batch

__all__ = ["NO_LENGTHS", "AttentionCall", "Lengths", "Prepared", "needs_grad", "packed_lengths", "padding_lengths"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCall:
    """A validated call's options (everything but the tensors).

    ``max_seqlen_*`` are the dense sequence lengths (S_q, S_kv) or the packed documents' bounds;
    ``scale`` is already positive (see :func:`cudnn_attention.validation.positive_scale`).
    """

    packed: bool
    padded: bool = False
    documents: int = 0  # packed: len(cu_seqlens) - 1; dense: 0
    max_seqlen_q: int
    max_seqlen_kv: int
    scale: float
    mask: MaskSpec = MaskSpec()
    has_sinks: bool = False
    need_lse: bool = False  # the caller wants the LSE, or the backward will need it
    needs_grad: bool = False
    deterministic: bool | None = None  # the backward's algorithm; None: torch's setting when the backward runs

    def replace(self, **changes) -> AttentionCall:
        return dataclasses.replace(self, **changes)

    def backward_deterministic(self) -> bool:
        """Whether the backward runs cuDNN's deterministic algorithm: the call's own ``deterministic``, else
        ``torch.are_deterministic_algorithms_enabled()`` as it reads now."""
        return self.deterministic if self.deterministic is not None else torch.are_deterministic_algorithms_enabled()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Lengths:
    """A call's index tensors, as the kernels take them: a padded dense call's per-row lengths (int32 (B,),
    already clamped, see :func:`cudnn_attention.masking.effective_lengths`), or a packed call's batch (its prefix
    sums and what is known and derived of them, :class:`~cudnn_attention.packed_batch.PackedBatch`); None where
    the call has none."""

    seqlens_q: torch.Tensor | None = None
    seqlens_kv: torch.Tensor | None = None
    batch: PackedBatch | None = None

    @property
    def cu_seqlens_q(self) -> torch.Tensor | None:
        return None if self.batch is None else self.batch.cu_seqlens_q

    @property
    def cu_seqlens_kv(self) -> torch.Tensor | None:
        return None if self.batch is None else self.batch.cu_seqlens_kv

    def tensors(self) -> tuple:
        """The four index tensors (None where absent), in the ops' order."""
        return self.seqlens_q, self.seqlens_kv, self.cu_seqlens_q, self.cu_seqlens_kv


NO_LENGTHS = Lengths()


class Prepared(NamedTuple):
    """A validated call: its options, and the tensors as the kernels take them (a copy or a folded scale may
    have replaced the caller's). ``key`` is the arguments' key when they came through unchanged (see
    :func:`served_key`; None: the next call must validate again). A tuple, not a frozen dataclass: one is made
    per call, and a tuple costs a third of the time."""

    call: AttentionCall
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor | None
    lengths: Lengths
    key: tuple | None = None


def needs_grad(q, k, v, sinks) -> bool:
    """Whether a backward will follow: grad mode is on and an input requires it."""
    # Plain boolean logic rather than any(generator): this runs on every call.
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    )


def padding_lengths(seqlens_q, seqlens_kv, B: int, S_q: int, S_kv: int, device) -> Lengths:
    """A padded call's per-row lengths as the kernels take them; an absent side is the full length."""
    len_q = seqlens_q if seqlens_q is not None else torch.full((B,), S_q, dtype=torch.int32, device=device)
    len_kv = seqlens_kv if seqlens_kv is not None else torch.full((B,), S_kv, dtype=torch.int32, device=device)
    len_q, len_kv = effective_lengths(len_q, len_kv, S_q, S_kv)
    return Lengths(seqlens_q=len_q, seqlens_kv=len_kv)


def packed_lengths(cu_seqlens_q, cu_seqlens_kv, tokens_q: int, tokens_kv: int) -> Lengths:
    """A packed call's :class:`Lengths`: the batch kept for these prefix sums (what was proved and derived of them), or a
    new one (see :func:`~cudnn_attention.packed_batch.registered_batch`; nothing is checked here)."""
    return Lengths(batch=registered_batch(cu_seqlens_q, cu_seqlens_kv, tokens_q, tokens_kv))
