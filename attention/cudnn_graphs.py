"""cuDNN frontend graphs for attention: specs, building, a bounded cache, handles and execution.

One graph per :class:`GraphSpec` (everything that changes the graph: dtype, dims, strides, scale,
mask, flags, device). Building happens once per spec; a spec cuDNN rejects is remembered, so the
caller can fall back without asking again. A memo beside the cache maps cheap call signatures to
what was resolved from them (a graph, a plan of graphs); its entries live and die with their graphs.

Execution hands the lowered backend plan a raw array of operand pointers in the order the backend
keeps them, when the frontend exposes that (see :func:`cudnn_attention._compat.backend_operand_uids`),
else a ``{uid: pointer}`` map; ``CUDNN_ATTENTION_PUBLIC_EXECUTE=1`` forces the public
``pygraph.execute``. Workspaces are kept per device and stream, as torch keeps cuBLAS's.
"""

from __future__ import annotations

import array
import atexit
import os
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

import torch

from . import _compat
from .masking import MaskSpec
from .policy import note_graph_build

__all__ = [
    "KNOWN_WRONG",
    "PACKED_D256_BACKWARD_WRONG",
    "GraphRejected",
    "GraphSpec",
    "built_plans",
    "clear_cache",
    "execute",
    "frontend_unavailable_reason",
    "get_graph",
    "graph_for_call",
    "known_wrong",
    "memoize",
    "memoized",
]

_CACHE_CAPACITY = 512
# Signatures per graph: packed calls change their token count every step, and each count is a
# signature of its own that resolves to the same bucketed graph, so the memo is bounded by itself too.
_MEMO_CAPACITY = 8 * _CACHE_CAPACITY
# Workspaces up to this size are kept per (device, stream) between calls; larger ones (a packed
# backward's dQ accumulator can take hundreds of MiB) come from the caching allocator each call.
_KEPT_WORKSPACE_BYTES = 64 << 20


class GraphRejected(RuntimeError):
    """cuDNN cannot build this graph on this GPU with the installed libraries."""


class GraphSpec(NamedTuple):
    """Everything that changes a cuDNN attention graph. Strides are (B, H, S, D) descriptor strides;
    for packed tensors ``batch``/``seq_*`` are bucketed upper bounds and ragged offsets locate documents."""

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
    grad_strides: tuple  # (dq, dk, dv) strides in the backward, () in the forward
    scale: float
    left: int
    right: int
    bottom_right: bool
    sinks: bool  # forward only: the backward gets dSink from an identity, not from the graph
    padded: bool
    packed: bool
    need_lse: bool
    total_q: int  # backward, packed: bucketed token counts that size cuDNN's dQ accumulator
    total_kv: int
    deterministic: bool


class _UID:
    Q, K, V, SINKS, SEQ_Q, SEQ_KV = 1, 2, 3, 4, 5, 6
    O, STATS = 100, 101
    DO, DQ, DK, DV = 200, 201, 202, 203
    FIRST_RAGGED = 300


class CompiledGraph:
    """A built graph plus what a call needs: operand uids in call order and ragged offset columns."""

    __slots__ = ("spec", "graph", "workspace_size", "uids", "ragged_columns", "lowered", "cpp_index", "pointer_order", "batch", "out_strides",
                 "grad_strides")  # fmt: skip

    def __init__(self, spec: GraphSpec, graph, workspace_size, uids, ragged_columns):
        self.spec = spec
        self.graph = graph
        self.batch = spec.batch  # packed: the bucketed document count the offsets are padded to
        self.out_strides = None if spec.packed else spec.o_strides  # dense: O's strides, decided once
        self.grad_strides = None if spec.packed else spec.grad_strides  # dense backward: dQ/dK/dV strides, decided once
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
# Frontend, handles and streams
# ----------------------------------------------------------------------------------------------

_frontend = None
_frontend_error: str | None = None


def _load_frontend():
    global _frontend, _frontend_error
    if _frontend is None and _frontend_error is None:
        try:
            import cudnn

            _frontend = cudnn
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
            _frontend_error = f"cuDNN frontend not importable ({type(exc).__name__}: {exc})"
    return _frontend


def frontend_unavailable_reason() -> str | None:
    """``None`` when ``import cudnn`` works, else why not (cached after the first try)."""
    _load_frontend()
    return _frontend_error


_thread_state = threading.local()


def _bound_handle(device_index: int):
    """``(handle, stream)``: this thread's cuDNN handle for the device, bound to torch's current stream.

    cuDNN handles are not thread-safe, hence one per thread; the stream is rebound only when it
    changes (``set_stream`` costs about 5 us).
    """
    handles = getattr(_thread_state, "handles", None)
    if handles is None:
        handles = _thread_state.handles = {}
    entry = handles.get(device_index)
    if entry is None:
        with torch.cuda.device(device_index):
            entry = handles[device_index] = [_load_frontend().create_handle(), None]
    stream = _compat.current_raw_stream(device_index)
    if entry[1] != stream:
        _frontend.set_stream(handle=entry[0], stream=stream)
        entry[1] = stream
    return entry[0], stream


# (device index, raw stream) -> uint8 buffer. Launches on one stream run in order, so one buffer
# serves them all; a stream torch hands out is never destroyed (it comes from a fixed pool), so a
# raw handle names the same queue for the life of the process.
_workspaces: dict = {}


def _workspace(size: int, device: torch.device, stream: int):
    """A buffer of at least ``size`` bytes for a launch on ``stream`` (None for no workspace). While a
    CUDA graph is captured, a fresh one from the graph's pool: a replay may run beside eager launches."""
    if not size:
        return None
    if size > _KEPT_WORKSPACE_BYTES or torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.uint8, device=device)
    key = (device.index, stream)
    buffer = _workspaces.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = _workspaces[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return buffer


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------

_cache: OrderedDict = OrderedDict()  # GraphSpec -> CompiledGraph | GraphRejected; the one bound (FIFO)
_build_lock = threading.Lock()
# Call signature -> (what was resolved from it, the specs of the graphs it holds): a steady-state call
# skips deriving specs (a few microseconds each). An entry goes with any of its graphs, so the memo
# never keeps an evicted graph alive, and the oldest go first past _MEMO_CAPACITY.
_by_call: dict = {}
_signatures: dict = {}  # GraphSpec -> {signature, ...} that hold it


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
                    for signature in _signatures.pop(evicted, ()):
                        _forget(signature)
    return entry


def _forget(signature) -> None:
    # Under _build_lock.
    entry = _by_call.pop(signature, None)
    if entry is not None:
        for spec in entry[1]:
            holders = _signatures.get(spec)
            if holders is not None:
                holders.discard(signature)


def memoized(signature):
    """What :func:`memoize` kept for ``signature``, or None."""
    entry = _by_call.get(signature)
    return None if entry is None else entry[0]


def memoize(signature, value, specs) -> None:
    """Keep ``value`` (resolved from graphs of ``specs``, every one in the cache) for ``signature``,
    for as long as each of those graphs stays cached."""
    with _build_lock:
        if signature in _by_call or not all(spec in _cache for spec in specs):  # evicted meanwhile
            return
        _by_call[signature] = (value, specs)
        for spec in specs:
            _signatures.setdefault(spec, set()).add(signature)
        if len(_by_call) > _MEMO_CAPACITY:
            _forget(next(iter(_by_call)))


def graph_for_call(signature: tuple, make_spec) -> CompiledGraph:
    """:func:`get_graph` behind the memo, keyed by a cheap call ``signature``; ``make_spec()`` runs on a
    miss. Rejections are kept too (their verdict is cached with the spec)."""
    entry = memoized(signature)
    if entry is None:
        spec = make_spec()
        entry = _cached_or_built(spec)
        memoize(signature, entry, (spec,))
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
        _signatures.clear()
        _workspaces.clear()


def _release_at_exit() -> None:
    """Drop every frontend object this package holds (graphs, handles) while the interpreter still
    runs: the frontend's nanobind bindings print a leak report of hundreds of lines at exit for any
    instance still alive when its module is torn down. Other threads' handles die with their threads."""
    clear_cache()
    _thread_state.__dict__.pop("handles", None)
    import gc

    gc.collect()


atexit.register(_release_at_exit)


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------


# What known_wrong holds back, as users read it (the doctor lists them).
PACKED_D256_BACKWARD_WRONG = "cuDNN's packed backward at D 256 with a different D_v returns wrong gradients (seen with cuDNN 9.19)"
KNOWN_WRONG = (PACKED_D256_BACKWARD_WRONG,)


def known_wrong(spec: GraphSpec) -> str | None:
    """Why cuDNN would compute ``spec``'s graph wrongly although it builds it, or None.

    Such a graph gets the verdict of a rejection, so its calls take the exact path, counted and warned about
    once, instead of returning wrong values. Each entry was found by the GPU fuzz (``tests/test_gpu_fuzz.py``)
    and is kept for every cuDNN version until a newer one is measured right.
    """
    if spec.direction == "backward" and spec.packed and spec.dim_qk > 192 and spec.dim_v != spec.dim_qk:
        # cuDNN 9.19 on an H200: the packed (ragged) backward at D 256 with D_v 80 or 128 returns NaN and garbage
        # in dQ/dK/dV (13 of 4,000 fuzz cases, every one of them); D_v 32, 64, 160, 192 passed a small sample and
        # dense graphs all passed, but the same engine serves them, so the whole D 256, D_v != D corner is held back.
        return PACKED_D256_BACKWARD_WRONG
    return None


def _build(spec: GraphSpec) -> CompiledGraph:
    """Build ``spec``'s graph on a fresh thread (see :func:`_on_a_fresh_stack`) with this thread's
    handle: this thread waits meanwhile, so the handle is never in two threads' hands at once."""
    cudnn = _load_frontend()
    if cudnn is None:
        raise GraphRejected(_frontend_error)
    wrong = known_wrong(spec)
    if wrong is not None:
        raise GraphRejected(wrong)
    return _on_a_fresh_stack(_construct, cudnn, spec, _bound_handle(spec.device_index)[0])


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
    fails), so it stays there: raising it here would add this stack to its traceback.
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


def _construct(cudnn, spec: GraphSpec, handle) -> CompiledGraph:
    with torch.cuda.device(spec.device_index):
        io_type = cudnn.data_type.HALF if spec.dtype == torch.float16 else cudnn.data_type.BFLOAT16
        g = cudnn.pygraph(
            handle=handle, io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT
        )
        B, H, H_kv, S_q, S_kv = spec.batch, spec.heads_q, spec.heads_kv, spec.seq_q, spec.seq_kv
        io = dict(data_type=io_type)

        def tensor(name, uid, dims, strides, **kw):
            return g.tensor(name=name, dim=list(dims), stride=list(strides), uid=uid, **(kw or io))

        q = tensor("q", _UID.Q, (B, H, S_q, spec.dim_qk), spec.q_strides)
        k = tensor("k", _UID.K, (B, H_kv, S_kv, spec.dim_qk), spec.k_strides)
        v = tensor("v", _UID.V, (B, H_kv, S_kv, spec.dim_v), spec.v_strides)
        o_dims = (B, H, S_q, spec.dim_v)
        stats_dims = (B, H, S_q, 1)
        stats_strides = (S_q * H, 1, H, 1) if spec.packed else (H * S_q, S_q, 1, 1)
        seq_q = seq_kv = None
        if spec.padded or spec.packed:
            int32 = dict(data_type=cudnn.data_type.INT32)
            seq_q = tensor("seq_len_q", _UID.SEQ_Q, (B, 1, 1, 1), (1, 1, 1, 1), **int32)
            seq_kv = tensor("seq_len_kv", _UID.SEQ_KV, (B, 1, 1, 1), (1, 1, 1, 1), **int32)

        ragged: dict[tuple[str, int], object] = {}

        def set_ragged(t, side: str, token_stride: int):
            # One offset column per (side, token stride): q/o/dq usually share one, k/v/dk/dv another.
            column = ragged.get((side, token_stride))
            if column is None:
                uid = _UID.FIRST_RAGGED + len(ragged)
                column = ragged[side, token_stride] = tensor(f"ragged_{uid}", uid, (B + 1, 1, 1, 1), (1, 1, 1, 1), data_type=cudnn.data_type.INT64)
            t.set_ragged_offset(column)

        if spec.packed:
            set_ragged(q, "q", spec.q_strides[2])
            set_ragged(k, "kv", spec.k_strides[2])
            set_ragged(v, "kv", spec.v_strides[2])
        left_bound, right_bound = MaskSpec(left=spec.left, right=spec.right).cudnn_bounds()
        mask_args = dict(
            diagonal_band_left_bound=left_bound,
            diagonal_band_right_bound=right_bound,
            diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT if spec.bottom_right else cudnn.diagonal_alignment.TOP_LEFT,
            use_padding_mask=spec.padded or spec.packed,
            seq_len_q=seq_q,
            seq_len_kv=seq_kv,
        )

        if spec.direction == "forward":
            sinks = tensor("sinks", _UID.SINKS, (1, H, 1, 1), (H, 1, 1, 1), data_type=cudnn.data_type.FLOAT) if spec.sinks else None
            o, stats = g.sdpa(
                name="attention", q=q, k=k, v=v, generate_stats=spec.need_lse, attn_scale=spec.scale, sink_token=sinks, **mask_args
            )
            o.set_uid(_UID.O).set_output(True).set_dim(list(o_dims)).set_stride(list(spec.o_strides)).set_data_type(io_type)
            uids = [_UID.Q, _UID.K, _UID.V, _UID.O]
            if spec.packed:
                set_ragged(o, "q", spec.o_strides[2])
            if spec.need_lse:
                stats.set_uid(_UID.STATS).set_output(True).set_dim(list(stats_dims)).set_stride(list(stats_strides))
                stats.set_data_type(cudnn.data_type.FLOAT)
                uids.append(_UID.STATS)
                if spec.packed:
                    set_ragged(stats, "q", H)
            if spec.sinks:
                uids.append(_UID.SINKS)
        else:
            o = tensor("o", _UID.O, o_dims, spec.o_strides)
            d_o = tensor("dO", _UID.DO, o_dims, spec.o_strides)
            stats = tensor("stats", _UID.STATS, stats_dims, stats_strides, data_type=cudnn.data_type.FLOAT)
            extra = {}
            if spec.packed:
                set_ragged(o, "q", spec.o_strides[2])
                set_ragged(d_o, "q", spec.o_strides[2])
                set_ragged(stats, "q", H)
                extra = dict(max_total_seq_len_q=spec.total_q, max_total_seq_len_kv=spec.total_kv)
            dq, dk, dv = g.sdpa_backward(
                name="attention_backward", q=q, k=k, v=v, o=o, dO=d_o, stats=stats, attn_scale=spec.scale,
                use_deterministic_algorithm=spec.deterministic, **mask_args, **extra,
            )  # fmt: skip
            dq_strides, dk_strides, dv_strides = spec.grad_strides
            for grad, uid, dims, strides, side in (
                (dq, _UID.DQ, (B, H, S_q, spec.dim_qk), dq_strides, "q"),
                (dk, _UID.DK, (B, H_kv, S_kv, spec.dim_qk), dk_strides, "kv"),
                (dv, _UID.DV, (B, H_kv, S_kv, spec.dim_v), dv_strides, "kv"),
            ):
                grad.set_uid(uid).set_output(True).set_dim(list(dims)).set_stride(list(strides)).set_data_type(io_type)
                if spec.packed:
                    set_ragged(grad, side, strides[2])
            uids = [_UID.Q, _UID.K, _UID.V, _UID.O, _UID.DO, _UID.STATS, _UID.DQ, _UID.DK, _UID.DV]
        if spec.padded or spec.packed:
            uids += [_UID.SEQ_Q, _UID.SEQ_KV]
        uids += [_UID.FIRST_RAGGED + i for i in range(len(ragged))]

        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return CompiledGraph(spec, g, g.get_workspace_size(), tuple(uids), tuple(ragged))


# ----------------------------------------------------------------------------------------------
# Execution
# ----------------------------------------------------------------------------------------------


def execute(graph: CompiledGraph, operands: list, device_index: int) -> None:
    """Launch ``graph`` on torch's current stream with ``operands`` in the graph's uid order. Only each
    operand's address is read (the graph holds the dims and strides), so an LSE or a length vector goes in
    as it is, not viewed to the graph's (B, H, S, 1) dims; the public ``pygraph.execute`` takes them the same
    way (``test_every_launch_path_gives_the_same_bits``)."""
    handle, stream = _bound_handle(device_index)
    workspace = _workspace(graph.workspace_size, operands[0].device, stream)
    workspace_ptr = workspace.data_ptr() if workspace is not None else 0
    if graph.pointer_order is not None:
        pointers = array.array("Q", [operands[i].data_ptr() for i in graph.pointer_order])
        _compat.execute_pointer_array(graph.lowered, pointers, workspace_ptr, graph.cpp_index, handle.backend_handle)
    elif graph.lowered is not None:
        pointers = {uid: t.data_ptr() for uid, t in zip(graph.uids, operands)}
        _compat.execute_lowered(graph.lowered, pointers, workspace_ptr, graph.cpp_index, handle.backend_handle)
    else:
        graph.graph.execute(operands, workspace, handle=handle, tensor_uids=graph.uids)
