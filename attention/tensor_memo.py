"""Values derived from index tensors, kept beside the tensor (never on it) while its contents cannot have changed.

Every layer of a packed forward, and every backward, gets the same ``cu_seqlens`` (or ``position_ids``) objects; what
is derived from them (a packed batch's facts, see :mod:`cudnn_attention.packed_batch`; the documents found in
``position_ids``) is computed once and kept in one table keyed by the tensor's identity, with what it depends on. An
entry is valid while the owner, and every partner tensor it was derived with, is the same object at the same version
(an in-place write bumps the version), and goes when its owner is freed. The caller's tensors get no attribute.

A kept value must not refer to its owner or partners: the table holds values strongly, so such a value would keep
them alive. Inference tensors track no version, so nothing is kept for them. Callers do not use the memo while
compiling or capturing a CUDA graph: kept tensors would outlive the graph's memory pool.
"""

from __future__ import annotations

import weakref

import torch

from . import _compat

__all__ = ["recall", "remember"]

_MAX_ENTRIES = 32  # per tensor; a handful of keys per batch in practice, so this only bounds the odd case
# id(owner) -> (weak reference to the owner, {key: (versions, partner references, value)}); an entry leaves with its owner.
_tables: dict[int, tuple[weakref.ref, dict]] = {}


def _versions(owner: torch.Tensor, partners: tuple) -> tuple | None:
    versions = tuple(_compat.tensor_version(t) for t in (owner, *partners))
    return None if None in versions else versions


def _table(owner: torch.Tensor) -> dict | None:
    entry = _tables.get(id(owner))
    return entry[1] if entry is not None and entry[0]() is owner else None


def recall(owner: torch.Tensor, key, *partners: torch.Tensor):
    """The value remembered for ``key`` on ``owner`` with these ``partners``, or None when there is
    none, or when one of the tensors was written (or replaced by another object) since."""
    table = _table(owner)
    entry = None if table is None else table.get(key)
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
    """Keep ``value`` for ``owner`` under ``key`` (a no-op for inference tensors). ``value`` must not refer to the
    tensors it is kept for (see the module's note)."""
    versions = _versions(owner, partners)
    if versions is None:
        return
    table = _table(owner)
    if table is None or len(table) >= _MAX_ENTRIES:
        table = {}
        address = id(owner)
        # The callback runs as the owner is freed, before its address can be reused: it drops exactly that owner's entry.
        _tables[address] = (weakref.ref(owner, lambda _, address=address: _tables.pop(address, None)), table)
    table[key] = (versions, tuple(weakref.ref(t) for t in partners), value)
