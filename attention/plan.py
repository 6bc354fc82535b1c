"""Which cuDNN graphs serve a call: the :class:`Plan`, resolved once per call value and tensor geometry.

One predicate for both directions (:func:`resolve`): when gradients will be needed the backward graph must
build too, so a call never starts on cuDNN and finishes elsewhere.

Sinks: the forward folds ``exp(sink_h)`` into the softmax denominator, with cuDNN's sink engine or with the
sink-less kernel plus :func:`~cudnn_attention.fused_sinks.fold_sinks` (:func:`sink_forward`), so the LSE
includes the sink either way. The backward never needs the sinks in its graph: the ordinary cuDNN backward
fed that LSE recomputes the right probabilities for dQ/dK/dV, and dSink has a closed form.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from . import dtypes
from .call import AttentionCall
from .call_keys import served_key
from .cudnn_graphs import graph_for, memoize, memoized
from .frontend import frontend_unavailable_reason
from .graph_build import CompiledGraph, GraphRejected

__all__ = ["Plan", "backward_graph", "build_plan", "device_unservable_reason", "resolve", "sink_forward"]

# How the sink forward runs: "engine" (cuDNN's sink engine), "fold" (the sink-less kernel, then one fused pass
# that folds the sinks into its output and LSE), or "auto", the default: the fold for packed calls, the engine
# for the rest. cuDNN 9.19's fast forward engine does not build a ragged graph with sinks, so a packed sink
# graph runs on a slower one (at the packed gpt-oss shape on an H200, 0.65-0.73 ms against 0.338 without sinks,
# window 128), while the fold takes 1.02-1.14x the sink-less forward. Dense sink graphs take 0.92-1.05x the
# sink-less forward, and the engine rounds the output to bf16 once where the fold rounds twice. The engine
# declines single-query rows (s_q = 1), which take the fold whatever the setting. The measurements:
# docs/decisions/0001-sink-forward-fold-or-engine.md.
_SINK_FORWARD = os.environ.get("CUDNN_ATTENTION_SINK_FORWARD", "auto")
_SINK_FORWARD_CHOICES = ("auto", "engine", "fold")


def sink_forward() -> str:
    """The sink-forward setting (``CUDNN_ATTENTION_SINK_FORWARD``: auto, engine or fold), checked. Part of every
    plan's key, so a changed setting resolves anew."""
    if _SINK_FORWARD not in _SINK_FORWARD_CHOICES:
        raise ValueError(f"CUDNN_ATTENTION_SINK_FORWARD={_SINK_FORWARD!r}: expected one of {', '.join(_SINK_FORWARD_CHOICES)}")
    return _SINK_FORWARD


class Plan(NamedTuple):
    """The graphs that serve one call, resolved once and handed to the kernels."""

    forward: CompiledGraph
    backward: CompiledGraph | None  # built up front when gradients will be needed
    folds_sinks: bool  # the forward graph is sink-less and the sinks are folded in afterwards
    deterministic: bool  # what the backward graph was resolved for

    @property
    def specs(self) -> tuple:
        return (self.forward.spec,) if self.backward is None else (self.forward.spec, self.backward.spec)


def device_unservable_reason(device) -> str | None:
    """Why cuDNN can serve no call on ``device`` (what :func:`resolve` answers every call there: ``"cpu tensors"``, or the
    missing frontend's reason), or None when it may serve some. For a check before any work, as strict mode needs."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} tensors"
    return frontend_unavailable_reason()


def resolve(q, k, v, call: AttentionCall) -> tuple[Plan | None, str | None]:
    """``(plan, None)`` when cuDNN serves this call, ``(None, reason)`` when it cannot.

    float16/bfloat16 meta tensors answer ``(None, None)`` too: the op serves them with its fake kernel. Under ``torch.compile`` graphs
    cannot be built while tracing, so the answer is ``(None, None)``: the op is traced, and a configuration cuDNN rejects takes the exact
    path inside the op at run time, counted and warned about there. A plan is kept for the call value and the tensors' geometry
    (:func:`~cudnn_attention.call.served_key`).
    """
    if q.device.type == "meta" and dtypes.cudnn_serves(q.dtype, backward=call.needs_grad):
        # Nothing is computed on meta tensors: the op's fake kernel gives the outputs a GPU call would, and FLOP counters
        # (Lightning's measure_flops builds its model on meta) count the op by its masks, not the exact path's full products.
        return None, None
    if not q.is_cuda:
        return None, f"{q.device.type} tensors"
    if not dtypes.cudnn_serves(q.dtype, backward=call.needs_grad):
        served = "/".join(str(dtype).removeprefix("torch.") for dtype in dtypes.cudnn_dtypes())
        return None, f"{q.dtype} inputs (cuDNN attention runs {served})"
    if torch.compiler.is_compiling():
        return None, None
    unavailable = frontend_unavailable_reason()
    if unavailable is not None:
        return None, unavailable
    key = served_key(("plan", call, sink_forward()), q, k, v)
    plan = memoized(key)
    if plan is None:
        try:
            plan = build_plan(q, k, v, call, deterministic=call.backward_deterministic())
        except GraphRejected as rejected:
            return None, str(rejected)
        memoize(key, plan, plan.specs)
    return plan, None


def _asks_sink_engine(call: AttentionCall) -> bool:
    """Whether a sink forward tries cuDNN's sink engine before the fold (see :func:`sink_forward`)."""
    setting = sink_forward()
    return setting == "engine" or (setting == "auto" and not call.packed)


def build_plan(q, k, v, call: AttentionCall, *, deterministic: bool) -> Plan:
    """The plan for ``call`` (raises :class:`~cudnn_attention.graph_build.GraphRejected`).

    Sinks: cuDNN's sink engine (dense calls, by default), which declines some shapes (9.19: a single query row,
    ``s_q == 1``, every gpt-oss decode step), or the sink-less graph plus the fold (packed calls, by default),
    which serves those too.
    """
    forward = None
    folds = call.has_sinks
    if call.has_sinks and _asks_sink_engine(call):
        try:
            forward, folds = graph_for("forward", call, q, k, v, deterministic=False), False
        except GraphRejected:
            pass
    if forward is None:
        # The fold needs the sink-less LSE: the graph's call drops the sinks and asks for the LSE.
        forward_call = call.replace(has_sinks=False, need_lse=True) if folds else call
        forward = graph_for("forward", forward_call, q, k, v, deterministic=False)
    backward = backward_graph(q, k, v, call, deterministic=deterministic) if call.needs_grad else None
    return Plan(forward, backward, folds, deterministic)


def backward_graph(q, k, v, call: AttentionCall, *, deterministic: bool) -> CompiledGraph:
    """The backward graph for ``call`` (raises :class:`~cudnn_attention.graph_build.GraphRejected`)."""
    return graph_for("backward", call, q, k, v, deterministic=deterministic)
