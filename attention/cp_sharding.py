"""Zigzag sharding of sequences over a context-parallel group, and each rank's sub-document plan: pure functions.

A row of L tokens (a packed batch's whole row, or one sequence of a dense batch) is cut into 2N chunks of C = L / (2N)
tokens; rank r holds chunks r and 2N-1-r, in that order. Under a causal mask chunk c costs about c + 1/2 chunks of
work, so every rank gets (r + 1/2) + (2N - 1 - r + 1/2) = 2N of it: the zigzag balances causal work exactly. Packed
documents are not cut at chunk borders: the row is, and a document spanning ranks is served piecewise (see
:func:`plan_rank`).

Each rank computes its own queries against the keys they can see. A piece of a document inside one chunk (queries
``[qa, qb)`` of document ``[ds, de)``) becomes a sub-document of one varlen call whose keys are a contiguous range of
absolute positions, aligned so that the mask, applied by the kernel inside the range, is the whole sequence's mask:

* no band (full attention within documents): keys ``[ds, de)``, no alignment needed;
* right bound 0 (causal, with or without a left window ``w``): keys ``[max(ds, qa - w), qb)`` bottom-right aligned,
  which puts query ``qa + i`` on key ``qa + i`` (the range ends where the queries end);
* a right bound ``r > 0``, or a left-only window: two calls merged by their LSEs, the keys up to the diagonal as
  above (sinks there, so each row's denominator gets its sink once) and the keys after it, ``[qa + 1, min(de, qb + r))``
  top-left aligned with window ``(0, r - 1)`` (query ``qa + i`` sees key ``qa + 1 + j`` iff ``i <= j <= i + r - 1``).

Queries and keys must be the same tokens (self-attention geometry): then top-left and bottom-right alignment of the
whole sequence coincide, and one plan serves both.

Where a window's reach fits in a chunk (left and right bounds at most C, neither unbounded), a rank's keys lie in its
own chunks and the ``left`` tokens before and ``right`` after each: it fetches just those from the neighbouring chunks'
owners (:func:`window_requests`) instead of gathering every rank's K/V.

Legend: N ranks, r a rank, C tokens per chunk, L row length, T packed tokens, S dense sequence length,
``[a, b)`` a half-open range of absolute positions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "KeyCall",
    "RankPlan",
    "check_shardable",
    "gather_rows",
    "window_requests",
    "window_rows",
    "plan_rank",
    "rank_chunks",
    "shard",
    "shard_positions",
    "unshard",
]


def check_shardable(length: int, world_size: int, *, what: str = "sequence") -> None:
    """Raise ValueError unless a row of ``length`` tokens can be cut into 2 x ``world_size`` equal chunks of at least one token."""
    if world_size < 1:
        raise ValueError(f"a context-parallel group has at least 1 rank, got world_size={world_size}")
    if length <= 0:
        raise ValueError(
            f"the {what} has {length} tokens: context parallelism needs at least {2 * world_size} (one per zigzag chunk), "
            "so that no rank is left without tokens"
        )
    if length % (2 * world_size):
        multiple = -(-length // (2 * world_size)) * 2 * world_size
        raise ValueError(
            f"the {what} has {length} tokens, not divisible by 2 x {world_size} ranks = {2 * world_size} zigzag chunks: pad it to "
            f"{multiple} tokens (cudnn_attention.integrations.hf.shard_batch_for_context_parallel pads to a multiple)"
        )


def rank_chunks(rank: int, world_size: int) -> tuple[int, int]:
    """The two chunks rank ``rank`` holds, in its local order: ``(rank, 2N - 1 - rank)``."""
    return rank, 2 * world_size - 1 - rank


def shard_positions(length: int, world_size: int, rank: int) -> torch.Tensor:
    """(L / N,) int64: the absolute positions of rank ``rank``'s tokens in its local order (chunk r, then chunk 2N-1-r)."""
    check_shardable(length, world_size)
    C = length // (2 * world_size)
    first, second = rank_chunks(rank, world_size)
    return torch.cat([torch.arange(first * C, (first + 1) * C), torch.arange(second * C, (second + 1) * C)])


def gather_rows(length: int, world_size: int) -> torch.Tensor:
    """(L,) int64: for each absolute position, its row in the rank-ordered concatenation of every rank's local tokens (what an
    all-gather returns). ``x_all.index_select(0, gather_rows(L, N))`` is the row in its original order."""
    check_shardable(length, world_size)
    C = length // (2 * world_size)
    chunk_C = torch.arange(2 * world_size).repeat_interleave(C)
    owner = torch.where(chunk_C < world_size, chunk_C, 2 * world_size - 1 - chunk_C)
    slot = (chunk_C >= world_size).long()
    return owner * 2 * C + slot * C + torch.arange(length) % C


def shard(x: torch.Tensor, *, world_size: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim`` (differentiable: ``index_select``)."""
    return x.index_select(dim, shard_positions(x.shape[dim], world_size, rank).to(x.device))


def unshard(shards: Sequence[torch.Tensor], *, dim: int) -> torch.Tensor:
    """The whole row from every rank's shard (``shards[r]`` is rank r's), in the original order (differentiable)."""
    rank_ordered = torch.cat(list(shards), dim=dim)
    return rank_ordered.index_select(dim, gather_rows(rank_ordered.shape[dim], len(shards)).to(rank_ordered.device))


@dataclass(frozen=True)
class KeyCall:
    """One attention call of a rank: its local queries cut into sub-documents (``cu_q``, covering every local token), each
    with the key range ``key_ranges[i]`` (absolute positions, ``[start, stop)``) gathered contiguously (``cu_kv``).

    ``window`` and ``bottom_right`` are the call's mask inside each sub-document; ``with_sinks``: whether this call adds
    the sinks (exactly one call of a plan does)."""

    cu_q: tuple[int, ...]
    cu_kv: tuple[int, ...]
    key_ranges: tuple[tuple[int, int], ...]
    max_q: int
    max_kv: int
    window: tuple[int, int]
    bottom_right: bool
    with_sinks: bool

    @property
    def selected_keys(self) -> int:
        """Rows of the contiguous key buffer this call reads (ranges of different sub-documents may overlap)."""
        return self.cu_kv[-1]

    def key_positions(self) -> torch.Tensor:
        """(selected_keys,) int64: the absolute positions of the call's keys, sub-document after sub-document."""
        if not self.key_ranges:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(start, stop) for start, stop in self.key_ranges])


@dataclass(frozen=True)
class RankPlan:
    """What rank ``rank`` of ``world_size`` computes for a row of ``length`` tokens: one call, or two whose results are merged
    by their LSEs (a band reaching past the diagonal)."""

    length: int
    world_size: int
    rank: int
    calls: tuple[KeyCall, ...]

    @property
    def selected_keys(self) -> int:
        return sum(call.selected_keys for call in self.calls)


def _pieces(cu: Sequence[int], a: int, b: int) -> list[tuple[int, int, int, int]]:
    """``(doc_start, doc_end, qa, qb)`` for each document meeting ``[a, b)``, in order; tokens past the last document (a
    capacity tail) come as one piece with ``doc_start = doc_end = qa`` (no keys)."""
    pieces = []
    # Document d holds [cu[d], cu[d + 1]); the first document ending after a contains a (empty documents end where they start).
    d = bisect.bisect_right(cu, a) - 1
    end = cu[-1]
    while d < len(cu) - 1 and cu[d] < b:
        ds, de = cu[d], cu[d + 1]
        qa, qb = max(a, ds), min(b, de)
        if qa < qb:
            pieces.append((ds, de, qa, qb))
        d += 1
    if b > end:
        tail = max(a, end)
        pieces.append((tail, tail, tail, b))
    return pieces


def _diagonal_keys(ds: int, qa: int, qb: int, left: int) -> tuple[int, int]:
    """Keys up to the diagonal of queries ``[qa, qb)``: back ``left`` tokens (-1: to the document start), up to ``qb``."""
    return (ds if left < 0 else max(ds, qa - left)), qb


def plan_rank(cu: Sequence[int], *, length: int, world_size: int, rank: int, left: int, right: int) -> RankPlan:
    """The calls rank ``rank`` makes for a row of ``length`` tokens holding documents ``cu`` (prefix sums, host ints; a dense
    row is one document ``(0, length)``) under window ``(left, right)`` (FlashAttention's convention, -1 unbounded,
    ``right = 0`` causal). See the module docstring for how each sub-document's keys are chosen."""
    check_shardable(length, world_size)
    C = length // (2 * world_size)
    pieces = [piece for chunk in rank_chunks(rank, world_size) for piece in _pieces(cu, chunk * C, (chunk + 1) * C)]
    if left < 0 and right < 0:
        # Full attention: a document's two pieces on this rank (the end of chunk r and the start of chunk 2N-1-r) are adjacent
        # in the local order and see the same keys, so they are one sub-document.
        merged: list[tuple[int, int, int, int]] = []
        for ds, de, qa, qb in pieces:
            if merged and de > ds and merged[-1][:2] == (ds, de):
                merged[-1] = (ds, de, merged[-1][2], merged[-1][3] + (qb - qa))  # qb counts local tokens from here on
            else:
                merged.append((ds, de, qa, qb))
        ranges = [(ds, de) for ds, de, _, _ in merged]
        calls = [_call([qb - qa for _, _, qa, qb in merged], ranges, window=(-1, -1), bottom_right=False, with_sinks=True)]
    else:
        lengths = [qb - qa for _, _, qa, qb in pieces]
        diagonal = [_diagonal_keys(ds, qa, qb, left) if de > ds else (ds, ds) for ds, de, qa, qb in pieces]
        calls = [_call(lengths, diagonal, window=(left, 0), bottom_right=True, with_sinks=True)]
        if right != 0:
            after = [(qa + 1, de if right < 0 else min(de, qb + right)) if de > ds else (ds, ds) for ds, de, qa, qb in pieces]
            after = [(start, max(start, stop)) for start, stop in after]
            calls.append(_call(lengths, after, window=(0, right - 1 if right > 0 else -1), bottom_right=False, with_sinks=False))
    return RankPlan(length=length, world_size=world_size, rank=rank, calls=tuple(calls))


def _call(q_lengths: list[int], key_ranges: list[tuple[int, int]], *, window, bottom_right: bool, with_sinks: bool) -> KeyCall:
    cu_q, cu_kv = [0], [0]
    for n, (start, stop) in zip(q_lengths, key_ranges):
        cu_q.append(cu_q[-1] + n)
        cu_kv.append(cu_kv[-1] + stop - start)
    return KeyCall(
        cu_q=tuple(cu_q),
        cu_kv=tuple(cu_kv),
        key_ranges=tuple(key_ranges),
        max_q=max(q_lengths, default=0),
        max_kv=max((stop - start for start, stop in key_ranges), default=0),
        window=tuple(window),
        bottom_right=bottom_right,
        with_sinks=with_sinks,
    )


def window_requests(length: int, world_size: int, *, left: int, right: int) -> tuple[tuple[tuple[int, int, int], ...], ...] | None:
    """For each rank, the rows it fetches from other ranks when its keys reach no further than ``left`` tokens before and
    ``right`` after its chunks: ``(owner rank, first local row, stop local row)`` of the owner's local tensor, in the order
    the rows are appended after the rank's own. None when a band does not fit within a chunk on both sides (then every
    rank gathers everything): no band, an unbounded side, or a reach longer than a chunk.

    Chunk c needs the last ``left`` tokens of chunk c-1 and the first ``right`` of chunk c+1; what its own rank holds
    (chunks N-1 and N are both rank N-1's) is not fetched."""
    check_shardable(length, world_size)
    C = length // (2 * world_size)
    if left < 0 or right < 0 or left > C or right > C:
        return None

    def owner(chunk: int) -> tuple[int, int]:  # (rank, first local row of the chunk)
        return (chunk, 0) if chunk < world_size else (2 * world_size - 1 - chunk, C)

    requests = []
    for rank in range(world_size):
        wanted = []
        for chunk in rank_chunks(rank, world_size):
            if left and chunk >= 1:
                peer, first = owner(chunk - 1)
                wanted.append((peer, first + C - left, first + C))
            if right and chunk <= 2 * world_size - 2:
                peer, first = owner(chunk + 1)
                wanted.append((peer, first, first + right))
        requests.append(tuple(request for request in wanted if request[0] != rank))
    return tuple(requests)


def window_rows(length: int, world_size: int, rank: int, requests) -> torch.Tensor:
    """(L,) int64: for each absolute position, its row in rank ``rank``'s buffer (its own tokens, then the fetched rows of
    ``window_requests(...)[rank]`` in order), -1 where the buffer does not hold it."""
    C = length // (2 * world_size)
    rows = torch.full((length,), -1, dtype=torch.int64)
    rows[shard_positions(length, world_size, rank)] = torch.arange(2 * C)
    order = gather_rows(length, world_size)  # position -> rank-ordered row: invert it for (owner, local row) -> position
    position_of = torch.empty_like(order)
    position_of[order] = torch.arange(length)
    next_row = 2 * C
    for peer, start, stop in requests[rank]:
        rows[position_of[peer * 2 * C + start : peer * 2 * C + stop]] = torch.arange(next_row, next_row + stop - start)
        next_row += stop - start
    return rows
