"""Context parallelism: the ranks of a process group each hold a zigzag shard of every sequence, and
:func:`cudnn_attention.attention`, :func:`cudnn_attention.varlen_attention` and ``attn_implementation="cudnn"`` take the
local tokens and return exactly what one process computes for the whole sequences, forward and backward.

Example:
    >>> from cudnn_attention import context_parallel
    >>> with context_parallel.over(cp_group):   # every rank of cp_group, each with its own shard
    ...     out_TlHD = cudnn_attention.varlen_attention(q_TlHD, k_TlHD, v_TlHD, cu, cu, max_len, max_len, causal=True,
    ...                                                  window_size=(127, 0), sinks=sinks)
    >>> # q/k/v: this rank's N-th of the packed row, zigzag order (cp_sharding.shard); cu: the WHOLE row's documents.

Inside the block (see :func:`over`):

* dense ``(B, H, S/N, D)`` tensors hold each sequence's chunks ``r`` and ``2N-1-r`` of ``2N`` (:mod:`.cp_sharding`);
  packed ``(T/N, H, D)`` tensors hold those chunks of the whole packed row, and ``cu_seqlens_*``/``max_seqlen_*``
  describe the whole row, so documents may span ranks. Outputs and LSEs come back in the same local order.
* Queries and keys are the same tokens (``S_q == S_kv``, ``cu_seqlens_q`` equal to ``cu_seqlens_kv``): cross-attention,
  KV-cache decoding and padded dense batches (``seqlens_*``) are refused with a ValueError; pack those (varlen).
* Every mask kind: full, causal, windows of any ``(left, right)``, either alignment (they coincide here), learnable sinks
  (each row's denominator gets its sink once), GQA. The sinks' gradient on each rank is its own rows' share: reduce it
  over the group with the other parameters' gradients (the context-parallel ranks take part in the data-parallel
  gradient average; see the README's "Context parallelism").

Algorithm (docs/decisions/0019): each rank all-gathers K and V (one collective; the backward reduce-scatters dK/dV),
or, for a band that fits within a chunk, fetches only the neighbouring chunks' rows it reaches (point to point); copies
the keys each of its sub-documents can see into one contiguous buffer (``index_select``), and makes one varlen call, or
two merged by their LSEs for a band reaching past the diagonal (:mod:`.cp_sharding` says which keys).

Before any collective, each call's shapes, dtypes, options and documents are compared across the group on the host
(``verify=True``, the default: one all-gather of two integers per call on a gloo group, no device synchronization): a
mismatch, or a bad input on any rank, raises the same ValueError on every rank, naming the rank and the values,
instead of a collective that never completes. Documents are read on the host once per batch: CUDA prefix sums cost
one device synchronization per new ``cu_seqlens`` tensor (counted in :func:`stats`), none when the batch helper
(:func:`remember_prefix_sums`, done by ``shard_batch_for_context_parallel``) gave their values already.

Legend: N ranks in the group, r this rank, B batch, H query heads, S/T sequence/packed length of the WHOLE row,
Tl = T / N local tokens, D head dim.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from types import SimpleNamespace

import torch

from . import api, cp_state, tensor_memo, validation
from .cp_collectives import STATS, Collectives, LocalSimulation, ProcessGroupCollectives, SimulatedWorld
from .cp_costs import RankCosts, costs_per_rank
from .cp_sharding import check_shardable, gather_rows, plan_rank, shard, shard_positions, unshard, window_requests, window_rows
from .masking import make_mask_spec

__all__ = [
    "Collectives",
    "ContextParallel",
    "LocalSimulation",
    "ProcessGroupCollectives",
    "RankCosts",
    "SimulatedWorld",
    "active",
    "average_gradients",
    "costs_per_rank",
    "gather_sequence",
    "merge_partials",
    "over",
    "remember_prefix_sums",
    "reset_stats",
    "shard",
    "shard_positions",
    "stats",
    "unshard",
]

_PREFIX_SUMS = "cudnn_attention.context_parallel: prefix sums"
_PLAN = "cudnn_attention.context_parallel: plan"
_INDEX_DTYPES = (torch.int32, torch.int64)


def over(group=None, *, collectives: Collectives | None = None, verify: bool = True) -> ContextParallel:
    """A context manager under which the attention calls of this rank are its shard of a context-parallel group.

    Args:
        group: the ``torch.distributed`` process group whose ranks shard the sequences (e.g. ``mesh["cp"].get_group()``);
            None: the default (whole-world) group. Ignored when ``collectives`` is given.
        collectives: another transport (:class:`LocalSimulation` runs an N-rank split in one process).
        verify: compare every call's shapes, options and documents across the group before any collective (default);
            False skips that host round trip, and a mismatch then fails inside (or hangs in) the collective.

    Returns a :class:`ContextParallel`; entering it makes every ``attention``/``varlen_attention`` call (and the
    transformers ``"cudnn"`` layer) context-parallel until the block exits, which restores what was active before.
    Enter it on every rank of the group around the same calls. Importing the package enables nothing.
    """
    if collectives is None:
        collectives = ProcessGroupCollectives(group)
    elif not isinstance(collectives, Collectives):
        raise TypeError(f"collectives must be a cudnn_attention.context_parallel.Collectives, got {type(collectives).__name__}")
    return ContextParallel(collectives, verify=verify)


def active() -> ContextParallel | None:
    """The :class:`ContextParallel` whose block the program is in, or None."""
    return cp_state.active


def stats() -> dict:
    """Counts since import (or :func:`reset_stats`): bytes this rank received (``all_gather_bytes``, ``reduce_scatter_bytes``,
    ``window_exchange_bytes``, forward and backward), ``metadata_checks``, ``prefix_sum_host_reads`` (device
    synchronizations), ``calls``, and the last call's ``gathered_key_rows`` and ``selected_key_rows`` (rows of the K/V it
    read keys from, gathered or fetched, and of the buffer its kernels read)."""
    return dict(STATS)


def reset_stats() -> None:
    """Zero :func:`stats`."""
    STATS.clear()


def remember_prefix_sums(cu_seqlens: torch.Tensor, values) -> None:
    """Keep the host values of ``cu_seqlens`` (a device tensor made from them) on the tensor, so that context-parallel calls
    read no device memory for it. The batch helpers do this when they move a batch's prefix sums to the GPU."""
    values = tuple(int(value) for value in values)
    if cu_seqlens.numel() != len(values):
        raise ValueError(f"cu_seqlens has {cu_seqlens.numel()} entries and {len(values)} values were given for it")
    tensor_memo.remember(cu_seqlens, _PREFIX_SUMS, values)


def average_gradients(parameters, *, group=None) -> None:
    """Average the gradients of ``parameters`` over ``group`` in place, as data-parallel training does: for a loop without
    DDP or FSDP. Under context parallelism every rank's gradient is its tokens' share (the sinks' too), and
    ``shard_batch_for_context_parallel`` scales each rank's loss so that the average is the whole batch's gradient.
    With DDP/FSDP, make the context-parallel ranks part of their data-parallel group instead (README)."""
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    world_size = dist.get_world_size(group)
    for dtype in sorted({g.dtype for g in grads}, key=str):  # one all-reduce per dtype (gloo has no AVG: sum, then divide)
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        flat /= world_size
        for g, part in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(part.view_as(g))


def gather_sequence(x_local: torch.Tensor, *, group=None, dim: int = 1) -> torch.Tensor:
    """The whole sequences from every rank's zigzag shard ``x_local`` along ``dim`` (for metrics and evaluation; not
    differentiable): an all-gather, then the original order."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    shards = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(shards, x_local.contiguous(), group=group)
    return unshard(shards, dim=dim)


class ContextParallel:
    """The state of a context-parallel block: this rank's :class:`Collectives` and options (made by :func:`over`).

    While the block is active, :func:`cudnn_attention.attention` and :func:`cudnn_attention.varlen_attention` hand their
    arguments to :meth:`serve`, which computes this rank's share of the whole call.
    """

    def __init__(self, collectives: Collectives, *, verify: bool):
        self.collectives, self.verify = collectives, verify
        self._previous: list = []
        # torch.compile breaks its graph around a call (host reads, collectives): made here, not at import, because
        # torch.compiler.disable imports dynamo, which `import cudnn_attention` must not pay for.
        self._serve_eagerly = torch.compiler.disable(self._serve)

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def world_size(self) -> int:
        return self.collectives.world_size

    def __enter__(self) -> ContextParallel:
        self._previous.append(cp_state.active)
        cp_state.active = self
        return self

    def __exit__(self, *exc) -> None:
        cp_state.active = self._previous.pop()

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, world_size={self.world_size}, collectives={type(self.collectives).__name__})"

    def serve(self, function: str, arguments: dict):
        """This rank's result of ``cudnn_attention.<function>(**arguments)`` (``"attention"`` or ``"varlen_attention"``), the
        tensors being this rank's shards; the same return values as the function (``validate`` is moot here)."""
        return self._serve_eagerly(function, SimpleNamespace(**arguments))

    def _serve(self, function: str, call: SimpleNamespace):
        packed = function == "varlen_attention"
        signature, problem, cu, mask = (), None, None, None
        try:
            mask = make_mask_spec(causal=call.causal, bottom_right=call.bottom_right, window_size=call.window_size)
            _check_local(call, packed=packed)
            signature = _signature(function, call, mask)
            if packed:
                cu = _host_prefix_sums(call.cu_seqlens_q, "cu_seqlens_q")
                signature += (("documents (cu_seqlens)", _digest(cu)), ("max_seqlen (q, kv)", (call.max_seqlen_q, call.max_seqlen_kv)))
        except (TypeError, ValueError) as error:
            problem = str(error)
        self._agree(signature, problem)
        N, local_tokens = self.world_size, call.q.shape[0 if packed else 2]
        L = N * local_tokens
        what = "packed row" if packed else "sequence"
        check_shardable(L, N, what=f"{what} ({local_tokens} tokens on each of {N} ranks)")
        if packed:
            _check_documents(cu, L, call.max_seqlen_q, call.max_seqlen_kv)
            out, lse = self._packed(call, cu, L, mask)
        else:
            out, lse = self._dense(call, L, mask)
        return (out, lse) if call.return_lse else out

    def _keys(self, call, L: int, mask, *, dim: int):
        """``(k, v, rows)``: the K/V this rank can read keys from, and for each absolute position its row there (-1: not
        held). A band that fits within a chunk fetches the neighbours' rows it reaches; anything else gathers every rank's."""
        requests = _window_requests(L, self.world_size, mask.left, mask.right)
        if requests is None:
            k_all, v_all = self.collectives.gather_kv(call.k, call.v, dim=dim)
            return k_all, v_all, _gather_rows(L, self.world_size)
        k_near, v_near = self.collectives.fetch_kv(call.k, call.v, dim=dim, requests=requests)
        rows = _window_rows(L, self.world_size, self.rank, mask.left, mask.right)
        return torch.cat([call.k, k_near], dim=dim), torch.cat([call.v, v_near], dim=dim), rows

    def _packed(self, call, cu: tuple, T: int, mask):
        k_all, v_all, order = self._keys(call, T, mask, dim=0)
        plan, tensors = self._varlen_plan(call.cu_seqlens_q, cu, T, mask, order, call.q.device)
        _note_call(k_all.shape[0], plan.selected_keys)
        results = []
        with _local_calls():
            for part, (cu_q, cu_kv, rows) in zip(plan.calls, tensors):
                k_sel, v_sel = k_all.index_select(0, rows), v_all.index_select(0, rows)
                local = _local_options(call, part)
                results.append(api.varlen_attention(call.q, k_sel, v_sel, cu_q, cu_kv, part.max_q, part.max_kv, **local))
        return results[0] if len(results) == 1 else merge_partials(*results[0], *results[1])

    def _dense(self, call, S: int, mask):
        N, q = self.world_size, call.q
        k_all, v_all, order = self._keys(call, S, mask, dim=2)
        if not mask.has_band:
            # Without a band a key's position does not matter: the rank-ordered gather is used as it is, no reordering.
            _note_call(S, S)
            with _local_calls():
                return api.attention(q, k_all, v_all, scale=call.scale, sinks=call.sinks, return_lse=True, deterministic=call.deterministic)
        plan = _dense_plan(S, N, self.rank, mask.left, mask.right)
        _note_call(k_all.shape[2], plan.selected_keys)
        C = q.shape[2] // 2
        outs, lses = [], []
        with _local_calls():
            for chunk in range(2):  # the rank's two chunks: each its own dense call(s), against the keys it can see
                q_chunk = q.narrow(2, chunk * C, C)
                parts = []
                for part in plan.calls:
                    start, stop = part.key_ranges[chunk]
                    if stop == start:  # e.g. nothing after the diagonal of the last chunk: that part adds nothing
                        continue
                    rows = _dense_rows(S, N, self.rank, mask.left, mask.right, start, stop, k_all.device)
                    k_part, v_part, padding = _at_least_as_many_keys(k_all.index_select(2, rows), v_all.index_select(2, rows), C)
                    parts.append(api.attention(q_chunk, k_part, v_part, **padding, **_local_options(call, part)))
                out, lse = parts[0] if len(parts) == 1 else merge_partials(*parts[0], *parts[1])
                outs.append(out)
                lses.append(lse)
        return _cat_sequence(outs, like=q), torch.cat(lses, dim=2)

    def _agree(self, signature: tuple, problem: str | None) -> None:
        """Raise the same ValueError on every rank when some rank's input is bad or the ranks' calls differ."""
        if not self.verify:
            if problem is not None:
                raise ValueError(f"context parallelism (rank {self.rank}): {problem}")
            return
        STATS["metadata_checks"] += 1
        # One small all-gather: whether each rank's input is bad, and a fingerprint of its call. Only when some rank's differs
        # do the ranks (every one of them: each sees the same table) exchange the records the message is made from.
        fingerprints = self.collectives.agree_ints((problem is not None, _fingerprint(signature)))
        if len(set(fingerprints)) == 1 and not fingerprints[0][0]:
            return
        records = self.collectives.agree((problem, signature))
        bad = [(rank, record[0]) for rank, record in enumerate(records) if record[0] is not None]
        if bad:
            where = ", ".join(str(rank) for rank, _ in bad)
            raise ValueError(f"context parallelism: bad input on rank {where}; rank {bad[0][0]}: {bad[0][1]}")
        # The first field is the call's kind: where the kinds agree, so do the fields' names.
        for fields in zip(*(record[1] for record in records)):
            if any(field != fields[0] for field in fields):
                seen = "; ".join(f"rank {rank}: {value!r}" for rank, (_, value) in enumerate(fields))
                name = fields[0][0]
                raise ValueError(
                    f"context parallelism: the ranks of the group disagree on {name} ({seen}): every rank must make the same "
                    "call with its own shard (same shapes, dtypes, options and documents)"
                )

    def _varlen_plan(self, cu_seqlens: torch.Tensor, cu: tuple, T: int, mask, order: torch.Tensor, device):
        """This rank's plan for the documents ``cu`` and its device tensors ``(cu_q, cu_kv, rows)`` per call (``order``: each
        position's row in the keys' buffer), kept on the prefix-sum tensor: every layer with the same mask shares them."""
        key = (_PLAN, T, self.world_size, self.rank, mask.left, mask.right, device)
        remembered = tensor_memo.recall(cu_seqlens, key)
        if remembered is not None:
            return remembered
        plan = plan_rank(cu, length=T, world_size=self.world_size, rank=self.rank, left=mask.left, right=mask.right)
        tensors = tuple(
            (
                _to_device(torch.tensor(call.cu_q, dtype=torch.int32), device),
                _to_device(torch.tensor(call.cu_kv, dtype=torch.int32), device),
                _to_device(_held(order[call.key_positions()]), device),
            )
            for call in plan.calls
        )
        tensor_memo.remember(cu_seqlens, key, (plan, tensors))
        return plan, tensors


def merge_partials(out1, lse1, out2, lse2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention over two disjoint key sets from each set's ``(out, lse)``: the softmax-weighted mean
    ``(o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2)`` and ``log(e^lse1 + e^lse2)``, in the LSE's dtype, differentiable. A row
    with no key in either set (both ``-inf``) stays zero with ``lse = -inf`` and passes no gradient."""
    m = torch.maximum(lse1, lse2).detach()  # any shift is exact; the larger keeps exp() <= 1
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)  # the double-where: log'(0) would send NaN back
    lse = torch.where(empty, float("-inf"), m + torch.log(total))
    out = out1.to(lse.dtype) * (w1 / total)[..., None] + out2.to(lse.dtype) * (w2 / total)[..., None]
    return out.to(out1.dtype), lse


@contextlib.contextmanager
def _local_calls():
    """The per-rank calls this layer makes are ordinary calls: context parallelism is off inside."""
    saved, cp_state.active = cp_state.active, None
    try:
        yield
    finally:
        cp_state.active = saved


def _note_call(gathered_rows: int, selected_rows: int) -> None:
    STATS["calls"] += 1
    STATS["gathered_key_rows"] = gathered_rows
    STATS["selected_key_rows"] = selected_rows


def _at_least_as_many_keys(k_part: torch.Tensor, v_part: torch.Tensor, queries: int) -> tuple:
    """``(k, v, options)`` for one dense per-rank call: cuDNN serves sliding windows only with at least as many keys as
    queries (9.19: "Sliding window attention is only supported with max_s_q <= max_s_kv"), which the part after the
    diagonal of a row's last chunk lacks (``C - 1`` keys for ``C`` queries). Such keys are padded to ``queries`` rows
    and the padding is masked by ``seqlens_kv`` (``options``): the same result, on cuDNN."""
    keys = k_part.shape[2]
    if keys >= queries:
        return k_part, v_part, {}
    pad = (0, 0, 0, queries - keys)
    lengths = _key_lengths(k_part.shape[0], keys, k_part.device)
    return torch.nn.functional.pad(k_part, pad), torch.nn.functional.pad(v_part, pad), {"seqlens_kv": lengths}


@functools.lru_cache(maxsize=16)
def _key_lengths(batch: int, keys: int, device) -> torch.Tensor:
    return torch.full((batch,), keys, dtype=torch.int32, device=device)  # made once per shape: no allocation per call


def _local_options(call, part) -> dict:
    """The keyword options of one per-rank call of a plan: the call's scale and determinism, the part's mask, and the
    sinks only where the plan puts them (each row's denominator gets its sink once)."""
    return dict(
        scale=call.scale,
        bottom_right=part.bottom_right,
        window_size=part.window,
        sinks=call.sinks if part.with_sinks else None,
        return_lse=True,
        deterministic=call.deterministic,
    )


def _check_local(call, *, packed: bool) -> None:
    """What one rank can check alone (its message goes to every rank through ``_agree``): the core's own checks of the
    tensors, then what context parallelism adds."""
    q, k, v = call.q, call.k, call.v
    validation.check_qkv(q, k, v, packed=packed)
    validation.check_sinks(call.sinks, q, q.shape[1])
    seq = 0 if packed else 2
    if not q.shape[seq] == k.shape[seq]:
        raise ValueError(
            "context parallelism serves self-attention (queries and keys are the same tokens): q and k must hold the same "
            f"number of local tokens, got q {tuple(q.shape)} and k {tuple(k.shape)} (KV-cache decoding and cross-attention "
            "are not context-parallel)"
        )
    if not packed and (call.seqlens_q is not None or call.seqlens_kv is not None):
        raise ValueError(
            "padded dense batches (seqlens_q/seqlens_kv) are not supported under context parallelism: pack the sequences "
            "instead (varlen_attention with the whole row's cu_seqlens; shard_batch_for_context_parallel does)"
        )
    if packed:
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            value = getattr(call, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be a Python int, got {value!r} ({type(value).__name__})")
        cu = _host_prefix_sums(call.cu_seqlens_q, "cu_seqlens_q")
        if call.cu_seqlens_kv is not call.cu_seqlens_q and _host_prefix_sums(call.cu_seqlens_kv, "cu_seqlens_kv") != cu:
            raise ValueError(
                "context parallelism serves self-attention (queries and keys are the same tokens): cu_seqlens_kv must equal cu_seqlens_q"
            )


def _signature(function: str, call, mask) -> tuple:
    """What must be equal on every rank, as ``(name, value)`` pairs of host values."""
    tensors = (call.q, call.k, call.v, call.sinks)
    return (
        ("call", function),
        ("dtype", str(call.q.dtype)),
        ("device type", call.q.device.type),
        ("local shape of q", tuple(call.q.shape)),
        ("local shape of k", tuple(call.k.shape)),
        ("local shape of v", tuple(call.v.shape)),
        ("window (left, right)", (mask.left, mask.right)),
        ("scale", call.scale),
        ("sinks shape", None if call.sinks is None else tuple(call.sinks.shape)),
        ("requires_grad of (q, k, v, sinks)", tuple(t is not None and t.requires_grad and torch.is_grad_enabled() for t in tensors)),
        ("return_lse", bool(call.return_lse)),
        ("deterministic", call.deterministic),
    )


def _fingerprint(signature: tuple) -> int:
    """A 63-bit digest of a call's signature, the same in every process (``hash()`` of a string is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(signature).encode(), digest_size=8).digest(), "little") >> 1


def _digest(cu: tuple) -> object:
    """The documents as compared across ranks: the prefix sums themselves when short, else a summary with a checksum."""
    if len(cu) <= 9:
        return cu
    return f"{len(cu) - 1} documents ending at {cu[-1]}, checksum {hash(cu) & 0xFFFFFFFF:08x}"  # int tuples hash alike in every process


def _host_prefix_sums(cu_seqlens, name: str) -> tuple:
    """The values of a prefix-sum tensor on the host: read once per tensor (a device synchronization for a CUDA tensor,
    counted), then kept on it while it is unchanged."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in _INDEX_DTYPES or not cu_seqlens.numel():
        described = (
            f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        )
        raise ValueError(f"{name} must be a non-empty 1-D int32/int64 tensor, got {described}")
    remembered = tensor_memo.recall(cu_seqlens, _PREFIX_SUMS)
    if remembered is not None:
        return remembered
    if cu_seqlens.device.type != "cpu":
        STATS["prefix_sum_host_reads"] += 1
    values = tuple(cu_seqlens.tolist())
    tensor_memo.remember(cu_seqlens, _PREFIX_SUMS, values)
    return values


def _check_documents(cu: tuple, T: int, max_seqlen_q: int, max_seqlen_kv: int) -> None:
    """The whole row's prefix sums against its length and the maxima (the same values on every rank: ``_agree`` compared them)."""
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > T:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end within the packed row's {T} tokens, got {_digest(cu)}")
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    if longest > min(max_seqlen_q, max_seqlen_kv):
        raise ValueError(f"max_seqlen_q/max_seqlen_kv ({max_seqlen_q}, {max_seqlen_kv}) must bound the longest document, {longest} tokens")


@functools.lru_cache(maxsize=64)
def _dense_plan(S: int, N: int, rank: int, left: int, right: int):
    return plan_rank((0, S), length=S, world_size=N, rank=rank, left=left, right=right)


# Pure functions of a few ints, asked by every call: computed once per shape (host tensors, a few bytes per token).
_gather_rows = functools.lru_cache(maxsize=16)(gather_rows)


@functools.lru_cache(maxsize=64)
def _window_requests(L: int, N: int, left: int, right: int):
    return window_requests(L, N, left=left, right=right)


@functools.lru_cache(maxsize=16)
def _window_rows(L: int, N: int, rank: int, left: int, right: int) -> torch.Tensor:
    return window_rows(L, N, rank, _window_requests(L, N, left, right))


@functools.lru_cache(maxsize=256)
def _dense_rows(S: int, N: int, rank: int, left: int, right: int, start: int, stop: int, device) -> torch.Tensor:
    """Rows of this rank's key buffer holding positions ``[start, stop)`` (see ``ContextParallel._keys``), on ``device``."""
    order = _gather_rows(S, N) if _window_requests(S, N, left, right) is None else _window_rows(S, N, rank, left, right)
    return _to_device(_held(order[start:stop]), device)


def _held(rows: torch.Tensor) -> torch.Tensor:
    """``rows``, after checking that the key buffer holds each of them (a plan reaching past the fetched window would
    otherwise read row -1, the buffer's last, silently)."""
    if rows.numel() and int(rows.min()) < 0:
        raise RuntimeError("cudnn_attention.context_parallel: a plan reads keys this rank did not fetch (a bug: please report it)")
    return rows


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)  # a copy queued on the stream, no wait for the GPU
    return t.to(device)


def _cat_sequence(outs: list, *, like: torch.Tensor) -> torch.Tensor:
    """The chunks' outputs along the sequence dim, in ``like``'s layout when it is a (B, S, H, D) view (transformers')."""
    if like.transpose(1, 2).is_contiguous() and not like.is_contiguous():
        return torch.cat([o.transpose(1, 2) for o in outs], dim=1).transpose(1, 2)
    return torch.cat(outs, dim=2)
