"""The keys remembered calls are found by: an argument key (the public functions' arguments as passed, before any
validation) and the one form of every key the memo beside the graph cache holds (:func:`served_key`). A key holds
everything that changes what it keeps, and nothing read from a tensor's values."""

from __future__ import annotations

import torch

from .call import needs_grad
from .masking import is_int_window

__all__ = ["argument_options", "served_key", "tensor_geometry"]


def tensor_geometry(q, k, v) -> tuple:
    """What of q/k/v validation, a plan and a graph depend on: shapes, strides, dtype and device."""
    return q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, k.dtype, v.dtype, k.device, v.device


def served_key(options: tuple, q, k, v) -> tuple:
    """The one form of every key the memo beside the graph cache holds (see
    :func:`cudnn_attention.cudnn_graphs.memoize`): ``options``, q/k/v's :func:`tensor_geometry` and the
    determinism setting.

    A key must hold everything that changes what it keeps: for an argument key (:func:`argument_options`)
    every option as the caller passed it, the index tensors' shapes, dtypes and devices (their values are
    read per call) and the sink-forward choice; for a plan, the :class:`AttentionCall` and the sink-forward
    choice; for a graph, its direction and the call. The geometry and the determinism setting are in every
    key, so no caller adds them by hand.
    """
    return options, tensor_geometry(q, k, v), torch.are_deterministic_algorithms_enabled()


def argument_options(q, k, v, scale, causal, bottom_right, window_size, sinks, return_lse, index_tensors, ints, sink_forward, options):
    """The options part of an argument key (:func:`served_key`), or None (validate every time) for tensor
    subclasses, options of other types than the documented ones (``True == 1`` and ``1.0 == 1`` as keys, but
    validation tells them apart) and while tracing. ``index_tensors``: the index tensors (their shapes,
    dtypes and devices go in); ``ints``: the packed maxima; ``options``: the values of the :data:`OP_OPTIONS` but the scale."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if not (scale is None or type(scale) is float):
        return None
    if type(causal) is not bool or type(bottom_right) is not bool or type(return_lse) is not bool:
        return None
    if not is_int_window(window_size):
        return None
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        return None
    index_key = []
    for t in index_tensors:
        if t is None:
            index_key.append(None)
        elif isinstance(t, torch.Tensor):
            index_key.append((t.shape, t.dtype, t.device))
        else:
            return None
    for n in ints:
        if type(n) is not int:
            return None
    for value in options:
        if not (value is None or type(value) is bool):
            return None
    if torch.compiler.is_compiling():
        return None
    sinks_key = None if sinks is None else (sinks.shape, sinks.dtype, sinks.device)
    grad = needs_grad(q, k, v, sinks)
    return (
        "arguments",
        scale,
        causal,
        bottom_right,
        window_size,
        return_lse,
        grad,
        sinks_key,
        tuple(index_key),
        ints,
        sink_forward,
        options,
    )
