"""Dense calls whose batch passes cuDNN's grid limit, served as batch chunks that each fit.

cuDNN's attention kernels fail at a batch of 65,536 (errata entry ``batch-or-heads-over-65535``), which a vision model
reaches by folding its windows into the batch, or a model with axial attention by folding the other axes. Batch rows
are independent, so such a call is the same call on consecutive slices of the batch: :func:`chunk_count` says how many,
:func:`chunks` cuts the prepared call (views, no copy), and :func:`joined` puts the chunks' outputs back together in the
layout one call would have returned. Each chunk is an ordinary call: it resolves, runs its backward and falls back on
its own, and the sinks it shares with the others get the sum of their gradients from autograd.

What a chunked call costs beyond its chunks: one copy of the output (and of the LSE when asked for) into the joined
tensor, and up to two graphs (the chunks are at most one row apart). A head count above the limit, and a packed batch of
more documents than it, are not chunked: their graphs are refused, and they take the exact path.

Legend: B batch, H heads, S sequence, D head dim.
"""

from __future__ import annotations

import torch

from . import dtypes, errata
from .call import Lengths, Prepared
from .frontend import cudnn_version
from .layouts import joined_results, split_evenly
from .plan import device_unservable_reason

__all__ = ["chunk_count", "chunks", "grid_limited_on", "joined", "joined_gradients"]


def chunk_count(prepared: Prepared) -> int:
    """How many batch chunks cuDNN serves this call in: 1, or ``ceil(B / GRID_LIMIT)`` for a dense call whose batch
    passes :data:`~cudnn_attention.errata.GRID_LIMIT` while its heads fit, in a dtype cuDNN takes, on a device cuDNN
    may serve and a cuDNN with that limit (:func:`grid_limited_on`). Host metadata only."""
    q = prepared.q
    batch = q.shape[0]
    if batch <= errata.GRID_LIMIT:  # first and alone: every call not remembered asks
        return 1
    call, k = prepared.call, prepared.k
    if call.packed or max(q.shape[1], k.shape[1]) > errata.GRID_LIMIT:
        return 1
    # A call cuDNN cannot serve anyway takes the exact path whole: one fallback, counted once.
    if not dtypes.cudnn_serves(q.dtype, backward=call.needs_grad) or not grid_limited_on(q.device.type):
        return 1
    return -(-batch // errata.GRID_LIMIT)


# Constant for the process (the device type's frontend, the library it loaded), so torch.compile reads it once while
# tracing instead of tracing into the frontend's loading.
@torch.compiler.assume_constant_result
def grid_limited_on(device_type: str) -> bool:
    """Whether cuDNN may serve calls on ``device_type`` and the cuDNN it loaded has the grid limit
    (:func:`~cudnn_attention.errata.grid_limited`)."""
    return device_unservable_reason(device_type) is None and errata.grid_limited(cudnn_version())


def chunks(prepared: Prepared, count: int) -> list[Prepared]:
    """``prepared`` cut into ``count`` consecutive batch slices at most one row apart (views of its tensors; a padded
    call's lengths sliced alike). The slices carry no served key: a key names the whole call's shapes."""
    call, lengths = prepared.call, prepared.lengths
    q_parts, k_parts, v_parts = (split_evenly(t, count, 0) for t in (prepared.q, prepared.k, prepared.v))
    if lengths.seqlens_q is None:
        length_parts = [lengths] * count
    else:
        length_parts = [
            Lengths(seqlens_q=len_q, seqlens_kv=len_kv)
            for len_q, len_kv in zip(split_evenly(lengths.seqlens_q, count, 0), split_evenly(lengths.seqlens_kv, count, 0))
        ]
    return [Prepared(call, *parts, prepared.sinks, part_lengths) for *parts, part_lengths in zip(q_parts, k_parts, v_parts, length_parts)]


def joined(parts: list) -> tuple:
    """The whole call's results from its chunks' result tuples, joined along the batch in the memory order of the first's
    (:func:`~cudnn_attention.layouts.joined_results`)."""
    return joined_results(parts, 0)


def joined_gradients(chunks: list[Prepared], results: list[tuple]) -> tuple:
    """The whole call's ``(dq, dk, dv, dsinks)`` from its chunks' (the provider's backward op, below autograd), joined
    along the batch: the provider's dense ops carry no sinks, whose gradient the chunks would share."""
    return joined(results)
