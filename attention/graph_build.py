"""Building one cuDNN frontend graph for a :class:`~cudnn_attention.graph_spec.GraphSpec`: its nodes, its plans, and what a
launch needs of it (:class:`CompiledGraph`). A graph the loaded cuDNN is known to compute wrongly or crash on
(:mod:`cudnn_attention.errata`, action ``refuse``) is rejected before anything is built. Builds run on a fresh thread
(docs/decisions/0008); the cache that keeps what is built is :mod:`cudnn_attention.cudnn_graphs`'.
"""

from __future__ import annotations

import os
import threading

import torch

from . import _compat, errata
from .dtypes import DTYPES
from .frontend import bound_handle, cudnn_version, frontend, frontend_unavailable_reason
from .graph_spec import GraphSpec

__all__ = ["CompiledGraph", "GraphRejected", "build", "every_plan"]


class GraphRejected(RuntimeError):
    """cuDNN cannot build this graph on this GPU with the installed libraries."""


class _UID:
    Q, K, V, SINKS, SEQ_Q, SEQ_KV = 1, 2, 3, 4, 5, 6
    OUT, STATS = 100, 101
    DO, DQ, DK, DV, DSINKS = 200, 201, 202, 203, 204
    FIRST_RAGGED = 300


class CompiledGraph:
    """A built graph plus what a call needs: operand uids in call order and ragged offset columns."""

    __slots__ = (
        "spec",
        "graph",
        "workspace_size",
        "uids",
        "ragged_columns",
        "lowered",
        "cpp_index",
        "pointer_order",
        "batch",
        "out_strides",
        "grad_strides",
        "full_lengths",
        "one_key_per_row",
        "mask",
        "has_sinks",
    )

    def __init__(self, spec: GraphSpec, graph, workspace_size, uids, ragged_columns):
        self.spec = spec
        self.graph = graph
        self.batch = spec.batch  # packed: the bucketed document count the offsets are padded to
        self.out_strides = None if spec.packed else spec.o_strides  # dense: O's strides, decided once
        self.grad_strides = None if spec.packed else spec.grad_strides  # dense backward: dQ/dK/dV strides, decided once
        # Dense graphs with a padding mask: (B, S_q, S_kv), the lengths an unpadded call passes (an erratum's reroute).
        self.full_lengths = (spec.batch, spec.seq_q, spec.seq_kv) if spec.padded and not spec.packed else None
        self.one_key_per_row = spec.mask.sees_at_most_one_key(packed=spec.packed, seq_kv=spec.seq_kv)
        self.mask = spec.mask  # what the packed row passes ask (keeps_diagonal)
        self.has_sinks = spec.sinks  # forward: cuDNN's sink engine; backward: the sinks in, dSink out (after dV)
        self.workspace_size = workspace_size
        self.uids = uids
        # ((side, token_stride), ...): each column is cu_seqlens_<side> * token_stride, in uid order.
        self.ragged_columns = ragged_columns
        self.lowered = None
        self.cpp_index = None
        # Indices into the call-order operands, in the backend's own operand order: set when the plan
        # takes a raw pointer array (one C call, no map built or copied per launch).
        self.pointer_order = None
        if os.environ.get("CUDNN_ATTENTION_PUBLIC_EXECUTE", "0") != "1" and graph.selected_engine is None:
            self.lowered, self.cpp_index = _compat.lowered_plan(graph) or (None, None)
            backend_uids = _compat.backend_operand_uids(graph) if self.lowered is not None else None
            if backend_uids is not None and sorted(backend_uids) == sorted(uids):
                self.pointer_order = tuple(uids.index(uid) for uid in backend_uids)

    @property
    def plan_name(self) -> str:
        return _compat.selected_plan_name(self.graph)


def build(spec: GraphSpec) -> CompiledGraph:
    """Build ``spec``'s graph on a fresh thread (see :func:`_on_a_fresh_stack`) with this thread's
    handle: this thread waits meanwhile, so the handle is never in two threads' hands at once."""
    cudnn = frontend()
    if cudnn is None:
        raise GraphRejected(frontend_unavailable_reason())
    erratum = errata.matching(spec, cudnn_version())
    if erratum is not None and erratum.action == errata.REFUSE:
        # Before anything is built: one of these crashes the process at plan creation.
        raise GraphRejected(f"known cuDNN bug ({erratum.key}): {erratum.what}")
    return _on_a_fresh_stack(_construct, cudnn, spec, bound_handle(spec.device_index)[0])


def every_plan(spec: GraphSpec) -> CompiledGraph:
    """``spec``'s graph, not cached, with every plan heuristics A and B and the fallback list offer built; plan 0 is
    the one :func:`get_graph` serves. For ``benchmarks/engine_plans.py``, which times each plan through
    ``graph.graph.execute_plan_at_index`` on a served call's operands."""
    cudnn = frontend()
    if cudnn is None:
        raise GraphRejected(frontend_unavailable_reason())
    return _on_a_fresh_stack(_construct, cudnn, spec, bound_handle(spec.device_index)[0], True)


def _on_a_fresh_stack(fn, *args):
    """``fn(*args)`` on a short-lived thread while this one waits: its result, or its error's message
    raised here as a fresh ``RuntimeError``.

    A frame left in a reference cycle keeps every frame that called it alive, through ``f_back``,
    until the cyclic GC's next full pass. Frontend 1.32's plan creation leaves one (its
    ``_create_backend_plans`` keeps a caught heuristics error in a local: frame -> error ->
    traceback -> frame), so a graph built inside a model's forward pinned that forward's
    activations: +4.5 GiB peak over two steps of a 36 GiB long-context fine-tuning step on an
    H200. A thread's stack starts at the thread, so the cycle reaches only the build's own frames.
    The error itself may sit in that cycle (the frontend raises the one it kept when every mode
    fails), so it stays there: raising it here would add this stack to its traceback. See
    docs/decisions/0008-graph-builds-run-on-a-fresh-thread.md.
    """
    outcome = []

    def run():
        try:
            outcome.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - every error goes to the waiting thread
            outcome.append((False, RuntimeError(str(exc) or type(exc).__name__)))

    worker = threading.Thread(target=run, name="cudnn-attention-graph-build", daemon=True)
    worker.start()
    worker.join()
    succeeded, value = outcome.pop()
    if succeeded:
        return value
    try:
        raise value
    finally:
        value = None  # the raised error's traceback holds this frame: no cycle through this local


class _Nodes:
    """One graph under construction: its tensors' common settings and the ragged offset columns they share."""

    def __init__(self, cudnn, spec: GraphSpec, handle):
        self.cudnn, self.spec = cudnn, spec
        self.io_type = getattr(cudnn.data_type, DTYPES[spec.dtype].cudnn_name)
        self.graph = cudnn.pygraph(
            handle=handle, io_data_type=self.io_type, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT
        )
        self.ragged: dict[tuple[str, int], object] = {}
        B, H, S_q = spec.batch, spec.heads_q, spec.seq_q
        self.o_dims = (B, H, S_q, spec.dim_v)
        self.stats_dims = (B, H, S_q, 1)
        self.stats_strides = (S_q * H, 1, H, 1) if spec.packed else (H * S_q, S_q, 1, 1)

    def tensor(self, name, uid, dims, strides, data_type=None):
        return self.graph.tensor(name=name, dim=list(dims), stride=list(strides), uid=uid, data_type=data_type or self.io_type)

    def set_ragged(self, t, side: str, token_stride: int) -> None:
        """Packed graphs only. One offset column per (side, token stride): q/o/dq usually share one, k/v/dk/dv another."""
        if not self.spec.packed:
            return
        column = self.ragged.get((side, token_stride))
        if column is None:
            uid = _UID.FIRST_RAGGED + len(self.ragged)
            column = self.tensor(f"ragged_{uid}", uid, (self.spec.batch + 1, 1, 1, 1), (1, 1, 1, 1), data_type=self.cudnn.data_type.INT64)
            self.ragged[side, token_stride] = column
        t.set_ragged_offset(column)

    def per_head(self, name, uid):
        """A float32 value per query head, ``(1, H, 1, 1)``: the sinks, and dSink."""
        H = self.spec.heads_q
        return self.tensor(name, uid, (1, H, 1, 1), (H, 1, 1, 1), data_type=self.cudnn.data_type.FLOAT)

    def output(self, t, uid, dims, strides, data_type=None) -> None:
        t.set_uid(uid).set_output(True).set_dim(list(dims)).set_stride(list(strides)).set_data_type(data_type or self.io_type)


def _construct(cudnn, spec: GraphSpec, handle, all_plans: bool = False) -> CompiledGraph:
    with torch.cuda.device(spec.device_index):
        nodes = _Nodes(cudnn, spec, handle)
        B, H_kv, S_kv = spec.batch, spec.heads_kv, spec.seq_kv
        q = nodes.tensor("q", _UID.Q, (B, spec.heads_q, spec.seq_q, spec.dim_qk), spec.q_strides)
        k = nodes.tensor("k", _UID.K, (B, H_kv, S_kv, spec.dim_qk), spec.k_strides)
        v = nodes.tensor("v", _UID.V, (B, H_kv, S_kv, spec.dim_v), spec.v_strides)
        nodes.set_ragged(q, "q", spec.q_strides[2])
        nodes.set_ragged(k, "kv", spec.k_strides[2])
        nodes.set_ragged(v, "kv", spec.v_strides[2])
        seq_q = seq_kv = None
        if spec.padded or spec.packed:
            int32 = cudnn.data_type.INT32
            seq_q = nodes.tensor("seq_len_q", _UID.SEQ_Q, (B, 1, 1, 1), (1, 1, 1, 1), data_type=int32)
            seq_kv = nodes.tensor("seq_len_kv", _UID.SEQ_KV, (B, 1, 1, 1), (1, 1, 1, 1), data_type=int32)
        mask_args = dict(
            **spec.mask.cudnn_diagonal(cudnn),
            use_padding_mask=spec.padded or spec.packed,
            seq_len_q=seq_q,
            seq_len_kv=seq_kv,
        )
        build_nodes = _forward_nodes if spec.direction == "forward" else _backward_nodes
        uids = build_nodes(nodes, q, k, v, mask_args)
        if spec.padded or spec.packed:
            uids += [_UID.SEQ_Q, _UID.SEQ_KV]
        uids += [_UID.FIRST_RAGGED + i for i in range(len(nodes.ragged))]

        g = nodes.graph
        g.validate()
        g.build_operation_graph()
        # all_plans (the plan benchmark): heuristic B's plans too, each built, the served one still first
        modes = [cudnn.heur_mode.A, cudnn.heur_mode.B] if all_plans else [cudnn.heur_mode.A]
        g.create_execution_plans([*modes, cudnn.heur_mode.FALLBACK])
        g.check_support()
        if all_plans:
            g.build_plans(cudnn.build_plan_policy.ALL)
        else:
            g.build_plans()
        return CompiledGraph(spec, g, g.get_workspace_size(), tuple(uids), tuple(nodes.ragged))


def _implementation(cudnn, spec: GraphSpec) -> dict:
    """The SDPA nodes' ``implementation`` keyword for ``spec``: none for "auto" (every frontend takes that; it is the
    binding's default), else ``cudnn.attention_implementation.<NAME>``, which a frontend without it rejects at build."""
    if spec.implementation == "auto":
        return {}
    return {"implementation": getattr(cudnn.attention_implementation, spec.implementation.upper())}


def _forward_nodes(nodes: _Nodes, q, k, v, mask_args: dict) -> list:
    """The forward node (sinks and the LSE as the spec says); returns the operand uids in call order."""
    spec, cudnn = nodes.spec, nodes.cudnn
    H = spec.heads_q
    sinks = nodes.per_head("sinks", _UID.SINKS) if spec.sinks else None
    o, stats = nodes.graph.sdpa(
        name="attention",
        q=q,
        k=k,
        v=v,
        generate_stats=spec.need_lse,
        attn_scale=spec.scale,
        sink_token=sinks,
        **mask_args,
        **_implementation(cudnn, spec),
    )
    nodes.output(o, _UID.OUT, nodes.o_dims, spec.o_strides)
    nodes.set_ragged(o, "q", spec.o_strides[2])
    uids = [_UID.Q, _UID.K, _UID.V, _UID.OUT]
    if spec.need_lse:
        nodes.output(stats, _UID.STATS, nodes.stats_dims, nodes.stats_strides, data_type=cudnn.data_type.FLOAT)
        nodes.set_ragged(stats, "q", H)
        uids.append(_UID.STATS)
    if spec.sinks:
        uids.append(_UID.SINKS)
    return uids


def _backward_nodes(nodes: _Nodes, q, k, v, mask_args: dict) -> list:
    """The backward node (dQ, dK, dV from O, dO and the LSE; with ``spec.sinks`` the sinks in and dSink out, after dV in
    the operands); returns the operand uids in call order."""
    spec, cudnn = nodes.spec, nodes.cudnn
    B, H, H_kv, S_q, S_kv = spec.batch, spec.heads_q, spec.heads_kv, spec.seq_q, spec.seq_kv
    sink_args, sink_uids = {}, []
    if spec.sinks:
        sinks, dsinks = nodes.per_head("sinks", _UID.SINKS), nodes.per_head("dsinks", _UID.DSINKS)
        nodes.output(dsinks, _UID.DSINKS, (1, H, 1, 1), (H, 1, 1, 1), data_type=cudnn.data_type.FLOAT)
        sink_args, sink_uids = {"sink_token": sinks, "dSink_token": dsinks}, [_UID.SINKS, _UID.DSINKS]
    o = nodes.tensor("o", _UID.OUT, nodes.o_dims, spec.o_strides)
    d_o = nodes.tensor("dO", _UID.DO, nodes.o_dims, spec.o_strides)
    stats = nodes.tensor("stats", _UID.STATS, nodes.stats_dims, nodes.stats_strides, data_type=cudnn.data_type.FLOAT)
    nodes.set_ragged(o, "q", spec.o_strides[2])
    nodes.set_ragged(d_o, "q", spec.o_strides[2])
    nodes.set_ragged(stats, "q", H)
    extra = dict(max_total_seq_len_q=spec.total_q, max_total_seq_len_kv=spec.total_kv) if spec.packed else {}
    dq, dk, dv = nodes.graph.sdpa_backward(
        name="attention_backward",
        q=q,
        k=k,
        v=v,
        o=o,
        dO=d_o,
        stats=stats,
        attn_scale=spec.scale,
        use_deterministic_algorithm=spec.deterministic,
        **mask_args,
        **extra,
        **sink_args,
        **_implementation(cudnn, spec),
    )
    dq_strides, dk_strides, dv_strides = spec.grad_strides
    for grad, uid, dims, strides, side in (
        (dq, _UID.DQ, (B, H, S_q, spec.dim_qk), dq_strides, "q"),
        (dk, _UID.DK, (B, H_kv, S_kv, spec.dim_qk), dk_strides, "kv"),
        (dv, _UID.DV, (B, H_kv, S_kv, spec.dim_v), dv_strides, "kv"),
    ):
        nodes.output(grad, uid, dims, strides)
        nodes.set_ragged(grad, side, strides[2])
    return [_UID.Q, _UID.K, _UID.V, _UID.OUT, _UID.DO, _UID.STATS, _UID.DQ, _UID.DK, _UID.DV, *sink_uids]
