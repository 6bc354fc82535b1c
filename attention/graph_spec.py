"""What changes a cuDNN attention graph: :class:`GraphSpec`, derived from a call by :func:`spec_for`.

One graph per spec (dtype, dims, strides, scale, mask, flags, device). Where the loaded cuDNN has a known bug in a
spec's graph and another graph computes the same cleanly, the spec is that other graph's
(:mod:`cudnn_attention.errata`, action ``reroute``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import errata
from .call import AttentionCall
from .frontend import cudnn_version
from .layouts import backward_rows, like_layout_strides, packed_bounds, thd_descriptor_strides
from .masking import MaskSpec

__all__ = ["DSINK_IN_GRAPH_SINCE", "GraphSpec", "dsink_in_graph", "spec_for"]

# cuDNN 9.28.1's dense backward writes dSink in the pass that already reads dO and O for its dO.O row sums, and it is
# faster there than the sink-less backward plus this package's sink-gradient pass over O and dO: 0.587 against 0.643 ms
# (dense gpt-oss B 2, S 4096, H 64/8, D 64, window 128, H100; 1.904 against 1.940 without the window), the same dSink
# error and bit-identical dQ/dK/dV. 9.19's took 1.420 ms, and 9.28's packed one 2.3x the pair (docs/decisions/0025).
DSINK_IN_GRAPH_SINCE = 92801


class GraphSpec(NamedTuple):
    """Everything that changes a cuDNN attention graph (built by keyword: :func:`spec_for`). Strides are (B, H, S, D)
    descriptor strides; for packed tensors ``batch``/``seq_*`` are bucketed upper bounds and ragged offsets locate
    documents."""

    direction: str  # "forward" | "backward"
    device_index: int
    dtype: torch.dtype
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    dim_qk: int
    dim_v: int
    q_strides: tuple
    k_strides: tuple
    v_strides: tuple
    o_strides: tuple  # also dO's in the backward
    scale: float
    mask: MaskSpec
    grad_strides: tuple = ()  # (dq, dk, dv) strides in the backward
    # The graph holds the sinks. Forward: cuDNN's sink engine. Backward: the graph also writes dSink (the frontend's
    # dSink_token), where :func:`dsink_in_graph` says so; other calls take dSink from an identity after the sink-less
    # backward (benchmarks/sink_backward.py measures the two).
    sinks: bool = False
    padded: bool = False
    packed: bool = False
    need_lse: bool = False
    total_q: int = 0  # backward, packed: bucketed token counts that size cuDNN's dQ accumulator
    total_kv: int = 0
    deterministic: bool = False
    # cuDNN's SDPA implementation family: "auto" (the heuristic's pick, what calls are served with), "composite" or
    # "unified" (cuDNN 9.2x's unified SDPA engines, the frontend 1.32 bindings' ``implementation=``): the plan
    # benchmark builds the others to time them (benchmarks/engine_plans.py --implementation).
    implementation: str = "auto"


def dsink_in_graph(call: AttentionCall, version: int | None, *, deterministic: bool) -> bool:
    """Whether ``call``'s backward graph holds the sinks and writes dSink itself (see :data:`DSINK_IN_GRAPH_SINCE`):
    dense calls without padding on cuDNN 9.28.1 or newer. Packed calls were slower that way, padded ones and the
    deterministic algorithm were not measured; they keep the sink-less backward and the sink-gradient pass."""
    return (
        call.has_sinks
        and not call.packed
        and not call.padded
        and not deterministic
        and version is not None
        and version >= DSINK_IN_GRAPH_SINCE
    )


def spec_for(direction: str, call: AttentionCall, q, k, v, *, deterministic: bool) -> GraphSpec:
    """The graph ``direction`` of ``call`` needs for these tensors (dense (B, H, S, D) or packed (T, H, D))."""
    backward = direction == "backward"
    H, H_kv, D, D_v = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    extra = {}
    if call.packed:
        batch, S_q = packed_bounds(documents=call.documents, max_seqlen=call.max_seqlen_q, tokens=q.shape[0])
        _, S_kv = packed_bounds(documents=call.documents, max_seqlen=call.max_seqlen_kv, tokens=k.shape[0])
        strides = dict(
            q_strides=thd_descriptor_strides(q, S_q),
            k_strides=thd_descriptor_strides(k, S_kv),
            v_strides=thd_descriptor_strides(v, S_kv),
            o_strides=(S_q * H * D_v, D_v, H * D_v, 1),
        )
        if backward:
            total_q, total_kv = backward_rows(packed=True, q=q, k=k)
            extra = dict(
                grad_strides=((S_q * H * D, D, H * D, 1), (S_kv * H_kv * D, D, H_kv * D, 1), (S_kv * H_kv * D_v, D_v, H_kv * D_v, 1)),
                total_q=total_q,
                total_kv=total_kv,
            )
    else:
        batch, S_q, S_kv = q.shape[0], q.shape[2], k.shape[2]
        strides = dict(
            q_strides=tuple(q.stride()),
            k_strides=tuple(k.stride()),
            v_strides=tuple(v.stride()),
            o_strides=like_layout_strides((batch, H, S_q, D_v), q),
        )
        if backward:
            extra = dict(grad_strides=tuple(like_layout_strides(tuple(t.shape), t) for t in (q, k, v)))
    spec = GraphSpec(
        direction=direction,
        device_index=q.device.index,
        dtype=q.dtype,
        batch=batch,
        heads_q=H,
        heads_kv=H_kv,
        seq_q=S_q,
        seq_kv=S_kv,
        dim_qk=D,
        dim_v=D_v,
        scale=float(call.scale),
        mask=call.mask,
        sinks=dsink_in_graph(call, cudnn_version(), deterministic=deterministic) if backward else call.has_sinks,
        padded=call.padded,
        packed=call.packed,
        need_lse=call.need_lse or backward,
        deterministic=deterministic and backward,
        **strides,
        **extra,
    )
    return _around_errata(spec)


def _around_errata(spec: GraphSpec) -> GraphSpec:
    """``spec``, or the graph that computes the same and is clean where the loaded cuDNN has a bug in ``spec``'s
    (:mod:`cudnn_attention.errata`, action ``reroute``): a dense graph with a padding mask whose lengths are all full
    (the launch passes them, see :func:`cudnn_attention.operands.length_operands`). Refusals are
    :func:`cudnn_attention.graph_build.build`'s."""
    erratum = errata.matching(spec, cudnn_version())
    if erratum is not None and erratum.action == errata.REROUTE:
        return spec._replace(padded=True)
    return spec
