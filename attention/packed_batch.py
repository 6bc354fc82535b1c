"""A packed batch as one value: its prefix sums and what is known and derived from them, built once per batch.

Every layer of a packed forward, and every backward, gets the same ``cu_seqlens`` objects. What a call needs of them,
beyond their shapes, is a handful of facts and tensors: whether they were checked (and with which bounds), whether they
put every token in a document, the kernels' per-document lengths and ragged offsets, and the masks of rows the kernels
leave unwritten. :class:`PackedBatch` holds all of it, built at the batch's first call by :func:`packed_batch` (the
public way in: the transformers layer calls it too), kept beside the prefix-sum tensors (:mod:`cudnn_attention.tensor_memo`:
while neither is written in place; nothing is set on them), and carried by the call's :class:`~cudnn_attention.call.Lengths`
to the kernels. torchtitan carries the same facts as its ``VarlenMetadata``.

Nothing here reads a device value on the host, except a host check asked for (``validate=True``, or CPU tensors). While
``torch.compile`` traces or a CUDA graph is captured nothing is kept: a value is built for that call alone.

Legend: T tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _compat, tensor_memo, validation

__all__ = ["PackedBatch", "packed_batch", "registered_batch"]

_NAMES = ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")


class _Facts:
    """What is known and derived of one batch's prefix sums, shared by every call of the batch. Holds no reference to
    the prefix sums themselves (it is kept beside them, see :mod:`cudnn_attention.tensor_memo`)."""

    __slots__ = ("checked", "covers_every_token", "derived")

    def __init__(self):
        self.covers_every_token = False
        self.checked: set = set()  # (max_seqlen_q, max_seqlen_kv, cover_all) it was checked against
        self.derived: dict = {}  # (what, ..., stream) -> tensors the kernels read


class PackedBatch(NamedTuple):
    """One packed batch: ``(documents + 1,)`` prefix sums of each side over ``tokens_q``/``tokens_kv`` packed tokens, and
    the facts every call of the batch shares (built at its first call, see :func:`packed_batch`).

    ``covers_every_token``: one prefix-sum tensor for both sides that ends exactly at the (equal) token counts, as proved
    by a check with ``cover_all`` (queued on the device, or on the host) before any kernel of this batch runs. With a mask
    that keeps the diagonal (:attr:`~cudnn_attention.masking.MaskSpec.keeps_diagonal`) the kernels then write every row.

    A NamedTuple, made per call (a frozen dataclass costs several times more): the facts inside are the batch's own.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    tokens_q: int
    tokens_kv: int
    facts: _Facts

    @property
    def documents(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @property
    def one_tensor(self) -> bool:
        """Whether q and kv share one prefix-sum tensor (equal documents by construction)."""
        return self.cu_seqlens_q is self.cu_seqlens_kv

    @property
    def covers_every_token(self) -> bool:
        return self.facts.covers_every_token

    def writes_every_row(self, mask) -> bool:
        """Whether the kernels write every row of this batch's outputs under ``mask``: nothing to fill or set."""
        return self.facts.covers_every_token and mask.keeps_diagonal

    def leaves_only_a_tail(self, mask) -> bool:
        """Whether the only rows the kernels leave unwritten are those past the last document: one prefix-sum tensor
        (every document with queries has keys) and a mask that keeps the diagonal (every key is seen by its own
        query). Two tensors may also leave the queries of documents without keys, and the keys of documents
        without queries (:mod:`cudnn_attention.packed_rows`)."""
        return self.one_tensor and mask.keeps_diagonal and not self.facts.covers_every_token

    def derived(self, key: tuple, compute):
        """``compute()``, kept in this batch under ``key`` for the current stream (kernels read it on that stream). Not
        while a CUDA graph is captured: its kernels must read tensors from the graph's own memory pool. ``compute``
        must return new tensors, not the prefix sums or views of them (the facts are kept beside those)."""
        cu = self.cu_seqlens_q
        if cu.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                return compute()
            key += (_compat.current_raw_stream(cu.get_device()),)
        derived = self.facts.derived
        value = derived.get(key)
        if value is None:
            value = derived[key] = compute()
        return value

    def check(self, max_seqlen_q: int, max_seqlen_kv: int, *, validate: bool, cover_all: bool, names=_NAMES) -> PackedBatch:
        """Check this batch against these bounds (see :func:`~cudnn_attention.validation.check_prefix_sums`), once per
        bounds; returns it. A check with ``cover_all`` also stands for the plain one, and proves
        :attr:`covers_every_token` where it ran. Host checks (``validate``) run every time they are asked for."""
        facts = self.facts
        key = (max_seqlen_q, max_seqlen_kv, cover_all)
        if not validate and key in facts.checked:
            return self
        ran = validation.check_prefix_sums(
            self.cu_seqlens_q,
            self.cu_seqlens_kv,
            self.tokens_q,
            self.tokens_kv,
            max_seqlen_q,
            max_seqlen_kv,
            validate=validate,
            cover_all=cover_all,
            names=names,
        )
        if not ran:  # nothing checked (compiling or capturing): nothing proved either
            return self
        facts.checked.add(key)
        if cover_all:
            facts.checked.add((max_seqlen_q, max_seqlen_kv, False))
            facts.covers_every_token = facts.covers_every_token or (self.one_tensor and self.tokens_q == self.tokens_kv)
        return self


def registered_batch(cu_seqlens_q, cu_seqlens_kv, tokens_q: int, tokens_kv: int) -> PackedBatch:
    """These prefix sums as a batch, with the facts kept for them (unchanged since), else new facts, kept (unless tracing
    or capturing, when they serve this call alone). Nothing is checked here: see :func:`packed_batch`."""
    keeps = _keeps(cu_seqlens_q)
    key = ("packed batch", tokens_q, tokens_kv)
    facts = tensor_memo.recall(cu_seqlens_q, key, cu_seqlens_kv) if keeps else None
    if facts is None:
        facts = _Facts()
        if keeps:
            tensor_memo.remember(cu_seqlens_q, key, facts, cu_seqlens_kv)
    return PackedBatch(cu_seqlens_q, cu_seqlens_kv, tokens_q, tokens_kv, facts)


def packed_batch(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    tokens_q: int,
    tokens_kv: int,
    device: torch.device | None = None,
    cover_all: bool = False,
    validate: bool = False,
    names: tuple[str, str, str, str] = _NAMES,
) -> PackedBatch:
    """The packed batch of these prefix sums, checked: built at its first call, then found again by every later call
    with the same tensors (every layer of a forward, every backward), until one of them is written in place.

    Args:
        cu_seqlens_q, cu_seqlens_kv: int32/int64 prefix sums, ``(documents + 1,)``, on the tokens' device.
        max_seqlen_q, max_seqlen_kv: non-negative bounds of the longest document (above the token count: the count).
        tokens_q, tokens_kv: the packed token counts T of each side.
        device: the tokens' device, which the prefix sums must be on (None: wherever ``cu_seqlens_q`` is).
        cover_all: the prefix sums must end exactly at T (every token in a document, as in a transformers batch).
        validate: check the values on the host with an error naming them (synchronizes); otherwise CPU tensors are
            checked on the host anyway and CUDA ones by a device-side assertion queued once per batch and bounds.
        names: the four arguments as the caller calls them, for the errors.

    Raises:
        TypeError, ValueError: bad metadata (dtype, shape, device, a negative bound), or, on the host, bad values.
    """
    if device is None and isinstance(cu_seqlens_q, torch.Tensor):
        device = cu_seqlens_q.device
    max_seqlen_q, max_seqlen_kv = validation.check_cu_seqlens(
        cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, device, total_q=tokens_q, total_kv=tokens_kv, names=names
    )
    batch = registered_batch(cu_seqlens_q, cu_seqlens_kv, tokens_q, tokens_kv)
    validate, cover_all = validation.check_flag(validate, "validate"), validation.check_flag(cover_all, "cover_all")
    return batch.check(max_seqlen_q, max_seqlen_kv, validate=validate, cover_all=cover_all, names=names)


def _keeps(cu: torch.Tensor) -> bool:
    """Whether a batch of ``cu`` may be kept: not while tracing (fake tensors carry no identity worth keeping) nor while a
    CUDA graph is captured (a replay runs whatever batch is copied into the captured tensors)."""
    if cu.is_meta or torch.compiler.is_compiling():
        return False
    return not (cu.is_cuda and torch.cuda.is_current_stream_capturing())
