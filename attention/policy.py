"""Which path served each call, and what happens when cuDNN cannot serve one.

Every call is counted: the cuDNN forward/backward, or the exact PyTorch fallback by reason.
A fallback warns once per reason; in strict mode it raises instead (``strict()``,
``set_strict(True)``, or the environment variable ``CUDNN_ATTENTION_STRICT=1``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from collections import Counter

import torch

__all__ = [
    "CudnnAttentionFallbackWarning",
    "StrictModeError",
    "count_provider",
    "env_flag",
    "fallback_output",
    "is_strict",
    "note_fallback",
    "reset_stats",
    "set_strict",
    "stats",
    "strict",
]


class CudnnAttentionFallbackWarning(UserWarning):
    """A call ran on the exact PyTorch path instead of cuDNN (emitted once per reason)."""


class StrictModeError(RuntimeError):
    """Raised in strict mode where a call would otherwise fall back from cuDNN."""


_lock = threading.Lock()
# ("cudnn", direction), ("fallback", direction, reason), ("provider", path) or ("provider", path, reason)
_served: Counter = Counter()
_build_seconds = 0.0  # spent building cuDNN graphs, both directions
_warned: set[str] = set()
_strict_global: bool | None = None
_strict_scope: contextvars.ContextVar[bool | None] = contextvars.ContextVar("cudnn_attention_strict", default=None)


def count_cudnn(direction: str) -> None:
    # Counter increments are atomic enough under the GIL for a statistic; no lock on the hot path.
    _served["cudnn", direction] += 1


def note_graph_build(direction: str, seconds: float) -> None:
    """Record one cuDNN graph build (or rejection) and its wall time: builds cost tens to hundreds of
    milliseconds each, so a run that keeps meeting new shapes pays for them step after step."""
    global _build_seconds
    with _lock:
        _served["graph_builds", direction] += 1
        _build_seconds += seconds


def count_provider(path: str, reason: str | None = None) -> None:
    """Record one call that reached the :mod:`~cudnn_attention.provider` overrides.

    ``path`` is ``"sdpa_forward"``, ``"sdpa_backward"``, ``"varlen_forward"`` or ``"varlen_backward"``
    when this project's op served it, ``"torch_forward"``/``"torch_backward"`` with a ``reason`` when
    it was handed to torch's own kernel. The hand-off warns once per reason but never raises in
    strict mode: torch's kernel computes the same function, so nothing is approximated.
    """
    if reason is None:
        _served["provider", path] += 1  # hot path: no lock, as in count_cudnn
        return
    message = f"cudnn_attention provider: handing this call to torch's own kernel: {reason}"
    _count_and_warn_once(("provider", path, reason), f"provider: {reason}", message, stacklevel=3)


def _count_and_warn_once(key: tuple, warned_as: str, message: str, *, stacklevel: int) -> None:
    """Count ``key``; warn with ``message`` the first time ``warned_as`` comes up (``stacklevel`` as seen from the caller)."""
    with _lock:
        _served[key] += 1
        first = warned_as not in _warned
        _warned.add(warned_as)
    if first:
        warnings.warn(message, CudnnAttentionFallbackWarning, stacklevel=stacklevel + 1)


def _provider_stats() -> dict:
    return {"sdpa_forward": 0, "sdpa_backward": 0, "varlen_forward": 0, "varlen_backward": 0, "torch_forward": {}, "torch_backward": {}}


def stats() -> dict:
    """How many calls each path served since import (or :func:`reset_stats`).

    Returns ``{"cudnn_forward": n, "cudnn_backward": n, "fallback_forward": {reason: n},
    "fallback_backward": {reason: n}, "provider": {...}}``. ``"provider"`` counts the calls that
    reached :func:`cudnn_attention.install`'s overrides: ``"sdpa_forward"``, ``"sdpa_backward"``,
    ``"varlen_forward"``, ``"varlen_backward"`` (served here, so also counted in ``cudnn_*``) and
    ``"torch_forward"``/``"torch_backward"`` ``{reason: n}`` (handed to torch's own kernel).
    ``"graph_builds"`` is ``{"forward": n, "backward": n, "seconds": s}``: cuDNN graphs built (or
    rejected) and the wall time spent on it. Calls replayed from a captured CUDA graph run no Python
    and are not counted.
    """
    with _lock:
        snapshot, build_seconds = dict(_served), _build_seconds
    result: dict = {"cudnn_forward": 0, "cudnn_backward": 0, "fallback_forward": {}, "fallback_backward": {}, "provider": _provider_stats(),
                    "graph_builds": {"forward": 0, "backward": 0, "seconds": build_seconds}}  # fmt: skip
    for key, count in snapshot.items():
        if key[0] == "cudnn":
            result[f"cudnn_{key[1]}"] += count
        elif key[0] == "graph_builds":
            result["graph_builds"][key[1]] = count
        elif key[0] == "provider":
            if len(key) == 2:
                result["provider"][key[1]] += count
            else:
                result["provider"][key[1]][key[2]] = count
        else:
            result[f"fallback_{key[1]}"][key[2]] = count
    return result


def reset_stats() -> None:
    """Zero every counter and forget which fallback reasons already warned."""
    global _build_seconds
    with _lock:
        _served.clear()
        _build_seconds = 0.0
        _warned.clear()


def is_strict() -> bool:
    """Whether fallbacks raise: the innermost :func:`strict` scope, else :func:`set_strict`, else the env var."""
    scoped = _strict_scope.get()
    if scoped is not None:
        return scoped
    if _strict_global is not None:
        return _strict_global
    return env_flag("CUDNN_ATTENTION_STRICT")


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to ``1``, ``true``, ``yes`` or ``on`` (any case)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def set_strict(enabled: bool | None) -> bool | None:
    """Set strict mode process-wide; ``None`` defers to ``CUDNN_ATTENTION_STRICT`` again.

    Returns the previous process-wide setting, so a caller can put it back.
    """
    global _strict_global
    previous = _strict_global
    _strict_global = None if enabled is None else bool(enabled)
    return previous


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Context manager: inside it every fallback from cuDNN raises :class:`StrictModeError`.

    Example:
        >>> with cudnn_attention.strict():
        ...     out = cudnn_attention.attention(q, k, v, causal=True)  # raises if cuDNN cannot serve it
    """
    token = _strict_scope.set(bool(enabled))
    try:
        yield
    finally:
        _strict_scope.reset(token)


class _CountFallbackBackward(torch.autograd.Function):
    """Identity whose backward records that the fallback served the gradient too."""

    @staticmethod
    def forward(ctx, out, reason):
        ctx.reason = reason
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        note_fallback("backward", ctx.reason)
        return grad_out, None


def fallback_output(out: torch.Tensor, reason: str, *, needs_grad: bool) -> torch.Tensor:
    """Arrange for the backward of a fallback output to be counted (the forward was recorded,
    and refused in strict mode, by :func:`note_fallback` before it ran)."""
    return _CountFallbackBackward.apply(out, reason) if needs_grad else out


def note_fallback(direction: str, reason: str) -> None:
    """Record one call served by the fallback; raise in strict mode, warn the first time per reason."""
    if direction == "forward" and is_strict():
        raise StrictModeError(f"cudnn_attention strict mode: cuDNN cannot serve this call ({reason})")
    message = f"cudnn_attention: running the exact PyTorch path, not cuDNN: {reason}"
    _count_and_warn_once(("fallback", direction, reason), reason, message, stacklevel=3)
