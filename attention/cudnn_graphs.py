"""cuDNN frontend graphs for attention: specs, building, and the one bounded cache.

One graph per :class:`GraphSpec` (everything that changes the graph: dtype, dims, strides, scale,
mask, flags, device), derived from a call by :func:`spec_for`. Building happens once per spec; a spec
cuDNN rejects is remembered, so the caller can fall back without asking again. A memo beside the cache
maps keys of calls (:func:`~cudnn_attention.call.served_key`) to what was resolved from them (a graph, a
plan of graphs); its entries live and die with their graphs. Launching a built graph is
:mod:`cudnn_attention.launch`'s.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

import torch

from . import _compat, errata, launch
from .call import AttentionCall, served_key
from .dtypes import DTYPES
from .layouts import MIN_SEQ_BUCKET, like_layout_strides, packed_bounds, shape_bucket, thd_descriptor_strides
from .masking import MaskSpec
from .policy import note_graph_build

__all__ = [
    "CompiledGraph",
    "GraphRejected",
    "GraphSpec",
    "built_plans",
    "clear_cache",
    "every_plan",
    "frontend_unavailable_reason",
    "get_graph",
    "graph_for",
    "memoize",
    "memoized",
    "spec_for",
]

# Re-exported: whether graphs can be built at all is asked of this module.
frontend_unavailable_reason = launch.frontend_unavailable_reason

_CACHE_CAPACITY = 512
# Keys per graph: packed calls change their token count every step, and each count is a key of its own that
# resolves to the same bucketed graph, so the memo is bounded by itself too.
_MEMO_CAPACITY = 8 * _CACHE_CAPACITY


class GraphRejected(RuntimeError):
    """cuDNN cannot build this graph on this GPU with the installed libraries."""


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
    sinks: bool = False  # forward only: the backward gets dSink from an identity, not from the graph
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
            extra = dict(
                grad_strides=((S_q * H * D, D, H * D, 1), (S_kv * H_kv * D, D, H_kv * D, 1), (S_kv * H_kv * D_v, D_v, H_kv * D_v, 1)),
                total_q=shape_bucket(q.shape[0], MIN_SEQ_BUCKET),
                total_kv=shape_bucket(k.shape[0], MIN_SEQ_BUCKET),
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
        sinks=call.has_sinks and not backward,
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
    (the launch passes them, see :func:`cudnn_attention.launch.run_backward`). Refusals are :func:`_build`'s."""
    erratum = errata.matching(spec, launch.cudnn_version())
    if erratum is not None and erratum.action == errata.REROUTE:
        return spec._replace(padded=True)
    return spec


class _UID:
    Q, K, V, SINKS, SEQ_Q, SEQ_KV = 1, 2, 3, 4, 5, 6
    OUT, STATS = 100, 101
    DO, DQ, DK, DV = 200, 201, 202, 203
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


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------

_cache: OrderedDict = OrderedDict()  # GraphSpec -> CompiledGraph | GraphRejected; the one bound (FIFO)
_build_lock = threading.Lock()
# Key of a call (call.served_key) -> (what was resolved from it, the specs of the graphs it holds): a steady-state call
# skips deriving specs (a few microseconds each). An entry goes with any of its graphs, so the memo
# never keeps an evicted graph alive, and the oldest go first past _MEMO_CAPACITY.
_by_call: dict = {}
_holders: dict = {}  # GraphSpec -> {key, ...} that hold it


def get_graph(spec: GraphSpec) -> CompiledGraph:
    """The compiled graph for ``spec``, building it on first use. Raises :class:`GraphRejected`."""
    entry = _cached_or_built(spec)
    if type(entry) is GraphRejected:
        raise _fresh(entry)
    return entry


def _fresh(rejected: GraphRejected) -> GraphRejected:
    # A cached verdict is never raised itself: raising attaches the raising frames to its traceback,
    # and the cache would keep them (and every tensor they hold) alive, a longer chain at each call.
    return GraphRejected(*rejected.args)


def _cached_or_built(spec: GraphSpec):
    entry = _cache.get(spec)
    if entry is None:
        with _build_lock:
            entry = _cache.get(spec)
            if entry is None:
                start = time.perf_counter()
                try:
                    entry = _build(spec)
                except Exception as exc:  # noqa: BLE001 - every build failure is a verdict to cache
                    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    entry = GraphRejected(f"cuDNN rejected the {spec.direction} graph: {message[:200]}")
                note_graph_build(spec.direction, time.perf_counter() - start)
                _cache[spec] = entry
                while len(_cache) > _CACHE_CAPACITY:
                    evicted, _ = _cache.popitem(last=False)
                    for key in _holders.pop(evicted, ()):
                        _forget(key)
    return entry


def _forget(key) -> None:
    # Under _build_lock.
    entry = _by_call.pop(key, None)
    if entry is not None:
        for spec in entry[1]:
            holders = _holders.get(spec)
            if holders is not None:
                holders.discard(key)


def memoized(key):
    """What :func:`memoize` kept for ``key``, or None."""
    entry = _by_call.get(key)
    return None if entry is None else entry[0]


def memoize(key, value, specs) -> None:
    """Keep ``value`` (resolved from graphs of ``specs``, every one in the cache) for ``key``,
    for as long as each of those graphs stays cached."""
    with _build_lock:
        if key in _by_call or not all(spec in _cache for spec in specs):  # evicted meanwhile
            return
        _by_call[key] = (value, specs)
        for spec in specs:
            _holders.setdefault(spec, set()).add(key)
        if len(_by_call) > _MEMO_CAPACITY:
            _forget(next(iter(_by_call)))


def graph_for(direction: str, call: AttentionCall, q, k, v, *, deterministic: bool) -> CompiledGraph:
    """The compiled graph serving ``direction`` of ``call`` on these tensors (raises :class:`GraphRejected`), found by
    the call's key (:func:`~cudnn_attention.call.served_key`), the whole steady-state cost; :func:`spec_for` runs on
    a miss. Rejections are kept too (their verdict is cached with the spec)."""
    key = served_key((direction, call, deterministic), q, k, v)
    entry = memoized(key)
    if entry is None:
        spec = spec_for(direction, call, q, k, v, deterministic=deterministic)
        entry = _cached_or_built(spec)
        memoize(key, entry, (spec,))
    if type(entry) is GraphRejected:
        raise _fresh(entry)
    return entry


def built_plans() -> list[tuple[str, str]]:
    """``(direction, engine plan name)`` of every graph in the cache, oldest first (benchmarks report them)."""
    return [(spec.direction, entry.plan_name) for spec, entry in list(_cache.items()) if isinstance(entry, CompiledGraph)]


def clear_cache() -> None:
    """Forget every built graph and cached rejection (tests; a changed environment)."""
    with _build_lock:
        _cache.clear()
        _by_call.clear()
        _holders.clear()
        launch.clear_workspaces()


def _release_at_exit() -> None:
    """Drop every frontend object this package holds (graphs, handles) while the interpreter still
    runs: the frontend's nanobind bindings print a leak report of hundreds of lines at exit for any
    instance still alive when its module is torn down. Other threads' handles die with their threads."""
    clear_cache()
    launch.release_handles()
    import gc

    gc.collect()


atexit.register(_release_at_exit)


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------


def _build(spec: GraphSpec) -> CompiledGraph:
    """Build ``spec``'s graph on a fresh thread (see :func:`_on_a_fresh_stack`) with this thread's
    handle: this thread waits meanwhile, so the handle is never in two threads' hands at once."""
    cudnn = launch.frontend()
    if cudnn is None:
        raise GraphRejected(launch.frontend_unavailable_reason())
    erratum = errata.matching(spec, launch.cudnn_version())
    if erratum is not None and erratum.action == errata.REFUSE:
        # Before anything is built: one of these crashes the process at plan creation.
        raise GraphRejected(f"known cuDNN bug ({erratum.key}): {erratum.what}")
    return _on_a_fresh_stack(_construct, cudnn, spec, launch.bound_handle(spec.device_index)[0])


def every_plan(spec: GraphSpec) -> CompiledGraph:
    """``spec``'s graph, not cached, with every plan heuristics A and B and the fallback list offer built; plan 0 is
    the one :func:`get_graph` serves. For ``benchmarks/engine_plans.py``, which times each plan through
    ``graph.graph.execute_plan_at_index`` on a served call's operands."""
    cudnn = launch.frontend()
    if cudnn is None:
        raise GraphRejected(launch.frontend_unavailable_reason())
    return _on_a_fresh_stack(_construct, cudnn, spec, launch.bound_handle(spec.device_index)[0], True)


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
    sinks = nodes.tensor("sinks", _UID.SINKS, (1, H, 1, 1), (H, 1, 1, 1), data_type=cudnn.data_type.FLOAT) if spec.sinks else None
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
    """The backward node (dQ, dK, dV from O, dO and the LSE); returns the operand uids in call order."""
    spec, cudnn = nodes.spec, nodes.cudnn
    B, H, H_kv, S_q, S_kv = spec.batch, spec.heads_q, spec.heads_kv, spec.seq_q, spec.seq_kv
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
    return [_UID.Q, _UID.K, _UID.V, _UID.OUT, _UID.DO, _UID.STATS, _UID.DQ, _UID.DK, _UID.DV]
