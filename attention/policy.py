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

__all__ = [
    "CudnnAttentionFallbackWarning",
    "StrictModeError",
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
_served: Counter = Counter()  # ("cudnn", direction) or ("fallback", direction, reason)
_warned: set[str] = set()
_strict_global: bool | None = None
_strict_scope: contextvars.ContextVar[bool | None] = contextvars.ContextVar("cudnn_attention_strict", default=None)


def count_cudnn(direction: str) -> None:
    # Counter increments are atomic enough under the GIL for a statistic; no lock on the hot path.
    _served["cudnn", direction] += 1


def stats() -> dict:
    """How many calls each path served since import (or :func:`reset_stats`).

    Returns ``{"cudnn_forward": n, "cudnn_backward": n, "fallback_forward": {reason: n},
    "fallback_backward": {reason: n}}``. Calls replayed from a captured CUDA graph run no Python
    and are not counted.
    """
    with _lock:
        snapshot = dict(_served)
    result: dict = {"cudnn_forward": 0, "cudnn_backward": 0, "fallback_forward": {}, "fallback_backward": {}}
    for key, count in snapshot.items():
        if key[0] == "cudnn":
            result[f"cudnn_{key[1]}"] += count
        else:
            result[f"fallback_{key[1]}"][key[2]] = count
    return result


def reset_stats() -> None:
    """Zero every counter and forget which fallback reasons already warned."""
    with _lock:
        _served.clear()
        _warned.clear()


def is_strict() -> bool:
    """Whether fallbacks raise: the innermost :func:`strict` scope, else :func:`set_strict`, else the env var."""
    scoped = _strict_scope.get()
    if scoped is not None:
        return scoped
    if _strict_global is not None:
        return _strict_global
    return os.environ.get("CUDNN_ATTENTION_STRICT", "0").strip().lower() in ("1", "true", "yes", "on")


def set_strict(enabled: bool | None) -> None:
    """Set strict mode process-wide; ``None`` defers to ``CUDNN_ATTENTION_STRICT`` again."""
    global _strict_global
    _strict_global = None if enabled is None else bool(enabled)


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


def note_fallback(direction: str, reason: str) -> None:
    """Record one call served by the fallback; raise in strict mode, warn the first time per reason."""
    if direction == "forward" and is_strict():
        raise StrictModeError(f"cudnn_attention strict mode: cuDNN cannot serve this call ({reason})")
    with _lock:
        _served["fallback", direction, reason] += 1
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(f"cudnn_attention: running the exact PyTorch path, not cuDNN: {reason}", CudnnAttentionFallbackWarning, stacklevel=4)
