"""The one bounded cache of built cuDNN graphs, and the memo beside it.

Building happens once per :class:`~cudnn_attention.graph_spec.GraphSpec`; a spec cuDNN rejects is remembered, so the
caller can fall back without asking again. A memo beside the cache maps keys of calls
(:func:`~cudnn_attention.call_keys.served_key`) to what was resolved from them (a graph, a plan of graphs); its entries
live and die with their graphs. Building a graph is :mod:`cudnn_attention.graph_build`'s, launching one
:mod:`cudnn_attention.launch`'s.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import OrderedDict

from . import frontend
from .call import AttentionCall
from .call_keys import served_key
from .graph_build import CompiledGraph, GraphRejected, build
from .graph_spec import GraphSpec, spec_for
from .policy import note_graph_build

__all__ = ["built_plans", "clear_cache", "get_graph", "graph_for", "memoize", "memoized"]

_CACHE_CAPACITY = 512
# Keys per graph: packed calls change their token count every step, and each count is a key of its own that
# resolves to the same bucketed graph, so the memo is bounded by itself too.
_MEMO_CAPACITY = 8 * _CACHE_CAPACITY

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
                    entry = build(spec)
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
        frontend.clear_workspaces()


def _release_at_exit() -> None:
    """Drop every frontend object this package holds (graphs, handles) while the interpreter still
    runs: the frontend's nanobind bindings print a leak report of hundreds of lines at exit for any
    instance still alive when its module is torn down. Other threads' handles die with their threads."""
    clear_cache()
    frontend.release_handles()
    import gc

    gc.collect()


atexit.register(_release_at_exit)
