"""What context parallelism asks of the ranks of its group, behind one small interface so that it can be swapped.

:class:`ProcessGroupCollectives` runs on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs). :class:`LocalSimulation`
runs the ranks of an N-rank split one after the other in a single process: the gathers return the shards every
simulated rank registered with its :class:`SimulatedWorld`, concatenated by ``torch.cat``, so one backward through all
ranks' outputs sums each shard's gradient as the reduce-scatter would. The per-rank attention calls are the same code
either way; the tests run both (the GPU test compares the simulated split with the unsplit cuDNN call).

Three operations:

* ``gather_kv(k, v, dim=)``: every rank's K and V concatenated along ``dim`` in rank order, differentiable (the
  backward reduce-scatters dK and dV, summed over the ranks that used them);
* ``fetch_kv(k, v, dim=, requests=)``: the rows of other ranks' K and V this rank asks for (``requests[rank]``:
  ``(owner, start, stop)``; every rank passes the whole table, so each knows what to send), differentiable (the backward
  sends each fetched row's gradient back to its owner): a sliding window's neighbours, point to point;
* ``agree_ints(values)`` and ``agree(record)``: every rank's few integers (a fingerprint of the call's shapes and
  options: one small all-gather per call) or small host record (exchanged only when the fingerprints differ, for the
  error message), for the check that turns a mismatch into the same ValueError on every rank instead of a collective
  that never completes. On a process group that is not gloo they run on a gloo twin of the group (host values only:
  no device synchronization).

Traffic is counted in :data:`STATS` (bytes each rank receives), read by :func:`cudnn_attention.context_parallel.stats`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

__all__ = ["STATS", "Collectives", "LocalSimulation", "ProcessGroupCollectives", "SimulatedWorld"]

# Counts since import or context_parallel.reset_stats(): bytes received per rank by each collective, metadata checks, ...
STATS: collections.Counter = collections.Counter()


class Collectives:
    """The interface: ``rank`` and ``world_size`` of this rank in its context-parallel group, ``gather_kv`` and ``agree``."""

    rank: int
    world_size: int

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor, *, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's ``k`` and ``v`` concatenated along ``dim`` in rank order (differentiable)."""
        raise NotImplementedError

    def fetch_kv(self, k: torch.Tensor, v: torch.Tensor, *, dim: int, requests) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``requests[self.rank]`` of other ranks' ``k`` and ``v`` along ``dim``, concatenated in order (differentiable)."""
        raise NotImplementedError

    def agree(self, record) -> list:
        """Every rank's ``record`` (a small picklable host value), in rank order."""
        raise NotImplementedError

    def agree_ints(self, values: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every rank's ``values`` (a few int64s, the same count on every rank), in rank order: one small collective."""
        raise NotImplementedError


class ProcessGroupCollectives(Collectives):
    """The collectives of ``group`` (default: the whole world) on ``torch.distributed``.

    ``metadata_group``: where :meth:`agree` runs; default: ``group`` itself when its backend is gloo, else a gloo group
    over the same ranks, created on first use (every rank of ``group`` reaches that point together: the first
    context-parallel call) and reused for the process's lifetime.
    """

    def __init__(self, group=None, *, metadata_group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "context parallelism over a process group needs torch.distributed initialized (init_process_group, or a "
                "launcher such as torchrun that does it): none is"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._metadata_group = metadata_group

    def gather_kv(self, k, v, *, dim):
        # One collective for both: K and V side by side in the last dimension (a small local copy; under GQA K/V are the small
        # tensors), tokens first so that each rank's block is contiguous in the gathered buffer.
        D = k.shape[-1]
        kv_local = torch.cat([k.movedim(dim, 0), v.movedim(dim, 0)], dim=-1)
        kv_all = _AllGatherRows.apply(self, kv_local)
        return kv_all[..., :D].movedim(0, dim), kv_all[..., D:].movedim(0, dim)

    def fetch_kv(self, k, v, *, dim, requests):
        D = k.shape[-1]
        kv_local = torch.cat([k.movedim(dim, 0), v.movedim(dim, 0)], dim=-1)
        fetched = _FetchRows.apply(self, kv_local, requests)
        return fetched[..., :D].movedim(0, dim), fetched[..., D:].movedim(0, dim)

    def exchange_rows(self, x: torch.Tensor, requests, *, backward: bool = False):
        """Forward: the rows ``requests[self.rank]`` of the other ranks' ``x``, concatenated. Backward (``x`` holds the
        gradient of those fetched rows): each piece goes back to its owner, and the pieces others fetched from this rank
        come back, in the order of ``requests`` (not differentiable)."""
        import torch.distributed as dist

        mine = requests[self.rank]
        # What each peer asked of this rank, in the peer's order: sends and receives between two ranks match in order.
        theirs = [(peer, start, stop) for peer, wanted in enumerate(requests) for owner, start, stop in wanted if owner == self.rank]
        ops, received = [], []
        if not backward:
            for owner, start, stop in mine:
                received.append(x.new_empty((stop - start, *x.shape[1:])))
                ops.append(dist.P2POp(dist.irecv, received[-1], self._global(owner), self.group))
            ops += [dist.P2POp(dist.isend, x[start:stop].contiguous(), self._global(peer), self.group) for peer, start, stop in theirs]
        else:
            offsets = [0]
            for _, start, stop in mine:
                offsets.append(offsets[-1] + stop - start)
            for (owner, _, _), a, b in zip(mine, offsets, offsets[1:]):
                ops.append(dist.P2POp(dist.isend, x[a:b].contiguous(), self._global(owner), self.group))
            for peer, start, stop in theirs:
                received.append(x.new_empty((stop - start, *x.shape[1:])))
                ops.append(dist.P2POp(dist.irecv, received[-1], self._global(peer), self.group))
        for request in dist.batch_isend_irecv(ops) if ops else ():
            request.wait()
        STATS["window_exchange_bytes"] += sum(t.numel() * t.element_size() for t in received)
        if not backward:
            return torch.cat(received) if received else x[:0]
        return received

    def _global(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def agree(self, record) -> list:
        import torch.distributed as dist

        records = [None] * self.world_size
        dist.all_gather_object(records, record, group=self.metadata_group())
        return records

    def agree_ints(self, values):
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.int64)
        every = mine.new_empty(self.world_size * mine.numel())
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(every, mine, group=self.metadata_group())
        return [tuple(row) for row in every.view(self.world_size, -1).tolist()]

    def metadata_group(self):
        """The gloo group :meth:`agree` runs on (see the class docstring)."""
        if self._metadata_group is None:
            self._metadata_group = _gloo_twin(self.group)
        return self._metadata_group

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(N x rows, ...): every rank's ``x`` (same shape on each) stacked along dim 0 in rank order (not differentiable)."""
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, x, group=self.group)
        STATS["all_gather_bytes"] += (self.world_size - 1) * x.numel() * x.element_size()
        return out

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(rows / N, ...): the sum over ranks of each rank's ``x``, this rank's block of rows (not differentiable)."""
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
        scatter(out, x, group=self.group)
        STATS["reduce_scatter_bytes"] += (self.world_size - 1) * out.numel() * out.element_size()
        return out


_GLOO_TWINS: dict = {}


def _gloo_twin(group):
    """``group`` itself when it is a gloo group, else a gloo group over its ranks (made once per group)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return group
    key = tuple(dist.get_process_group_ranks(group)) if group is not None else None
    if key not in _GLOO_TWINS:
        ranks = None if group is None else list(key)
        _GLOO_TWINS[key] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=group is not None)
    return _GLOO_TWINS[key]


class _AllGatherRows(torch.autograd.Function):
    """All-gather along dim 0; its backward reduce-scatters the gradient (each rank gets the sum, over every rank, of the
    gradient of its own rows)."""

    @staticmethod
    def forward(ctx, collectives: ProcessGroupCollectives, x_local):
        ctx.collectives = collectives
        return collectives.all_gather_rows(x_local)

    @staticmethod
    def backward(ctx, grad_all):
        return None, ctx.collectives.reduce_scatter_rows(grad_all)


class _FetchRows(torch.autograd.Function):
    """Point-to-point fetch of other ranks' rows; its backward returns each fetched row's gradient to its owner."""

    @staticmethod
    def forward(ctx, collectives: ProcessGroupCollectives, x_local, requests):
        ctx.collectives, ctx.requests, ctx.shape = collectives, requests, x_local.shape
        return collectives.exchange_rows(x_local, requests)

    @staticmethod
    def backward(ctx, grad_fetched):
        collectives, requests = ctx.collectives, ctx.requests
        grad_local = grad_fetched.new_zeros(ctx.shape)
        theirs = [(start, stop) for wanted in requests for owner, start, stop in wanted if owner == collectives.rank]
        for (start, stop), piece in zip(theirs, collectives.exchange_rows(grad_fetched.contiguous(), requests, backward=True)):
            grad_local[start:stop] += piece
        return None, grad_local, None


class SimulatedWorld:
    """An N-rank split simulated in one process: register each gathered tensor's shards (:meth:`share`), then run each rank's
    calls under ``context_parallel.over(collectives=world.rank(r))``.

    Example:
        >>> world = SimulatedWorld(2)
        >>> world.share(k_shards); world.share(v_shards)   # rank-ordered lists of each rank's local K and V
        >>> for r in range(2):
        ...     with context_parallel.over(collectives=world.rank(r)):
        ...         outs.append(cudnn_attention.varlen_attention(q_shards[r], k_shards[r], v_shards[r], cu, cu, m, m, causal=True))
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._shared: list[list[torch.Tensor]] = []

    def share(self, shards: Sequence[torch.Tensor]) -> None:
        """Register one tensor's shards, ``shards[r]`` being rank r's local tensor (the very object rank r will pass)."""
        if len(shards) != self.world_size:
            raise ValueError(f"a simulated world of {self.world_size} ranks needs {self.world_size} shards, got {len(shards)}")
        self._shared.append(list(shards))

    def rank(self, rank: int) -> LocalSimulation:
        """The collectives of simulated rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return LocalSimulation(self, rank)

    def shards_of(self, local: torch.Tensor, rank: int) -> list[torch.Tensor]:
        for shards in self._shared:
            if shards[rank] is local:
                return shards
        raise ValueError(
            f"simulated rank {rank} gathers a tensor of shape {tuple(local.shape)} that was not shared with SimulatedWorld.share "
            "(the local K and V of each rank must be the very objects registered)"
        )


class LocalSimulation(Collectives):
    """Rank ``rank`` of a :class:`SimulatedWorld`: gathers are concatenations of the registered shards, and every rank
    agrees (one process cannot disagree with itself)."""

    def __init__(self, world: SimulatedWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.world_size

    def gather_kv(self, k, v, *, dim):
        return torch.cat(self.world.shards_of(k, self.rank), dim=dim), torch.cat(self.world.shards_of(v, self.rank), dim=dim)

    def fetch_kv(self, k, v, *, dim, requests):
        pieces = []
        for local in (k, v):
            shards = self.world.shards_of(local, self.rank)
            rows = [shards[owner].narrow(dim, start, stop - start) for owner, start, stop in requests[self.rank]]
            pieces.append(torch.cat(rows, dim=dim) if rows else local.narrow(dim, 0, 0))
        return pieces[0], pieces[1]

    def agree(self, record) -> list:
        return [record] * self.world_size

    def agree_ints(self, values):
        return [tuple(values)] * self.world_size
