"""Values derived from index tensors, kept on the tensor while its contents cannot have changed.

Every layer of a packed forward, and every backward, gets the same ``cu_seqlens`` (or
``position_ids``) objects; what is derived from them (the kernels' lengths and offsets, the
device-side check of the prefix sums, the documents found in ``position_ids``) is computed once and
stored on the tensor, keyed by what it depends on. An entry is valid while the owner, and every
partner tensor it was derived with, is the same object at the same version (an in-place write
bumps the version). Inference tensors track no version, so nothing is kept for them. Callers do
not use the memo while compiling or capturing a CUDA graph: kept tensors would outlive the graph's
memory pool.
"""

from __future__ import annotations

import weakref

import torch

from . import _compat

__all__ = ["recall", "remember"]

_ATTRIBUTE = "_cudnn_attention_memo"
_MAX_ENTRIES = 32  # per tensor; a handful of keys per batch in practice, so this only bounds the odd case


def _versions(owner: torch.Tensor, partners: tuple) -> tuple | None:
    versions = tuple(_compat.tensor_version(t) for t in (owner, *partners))
    return None if None in versions else versions


def recall(owner: torch.Tensor, key, *partners: torch.Tensor):
    """The value remembered for ``key`` on ``owner`` with these ``partners``, or None when there is
    none, or when one of the tensors was written (or replaced by another object) since."""
    memo = getattr(owner, _ATTRIBUTE, None)
    entry = None if memo is None else memo.get(key)
    if entry is None:
        return None
    versions, partner_refs, value = entry
    if versions != _versions(owner, partners) or len(partner_refs) != len(partners):
        return None
    for ref, partner in zip(partner_refs, partners):
        if ref() is not partner:  # a dead partner's id may be reused by another tensor
            return None
    return value


def remember(owner: torch.Tensor, key, value, *partners: torch.Tensor) -> None:
    """Keep ``value`` on ``owner`` under ``key`` (a no-op for inference tensors)."""
    versions = _versions(owner, partners)
    if versions is None:
        return
    memo = getattr(owner, _ATTRIBUTE, None)
    if memo is None or len(memo) >= _MAX_ENTRIES:
        memo = {}
        setattr(owner, _ATTRIBUTE, memo)
    memo[key] = (versions, tuple(weakref.ref(t) for t in partners), value)
