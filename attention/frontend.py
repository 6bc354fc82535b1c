"""The cuDNN frontend: importing it, the library version it loaded, one handle per thread bound to torch's stream, and
the workspaces graphs run with.

Importing the frontend is deferred to the first GPU call (a CPU-only process never pays it), and a failure is kept as
the reason every call then gives for the exact path. Handles are not thread-safe, hence one per thread and device;
workspaces are kept per device and stream, as torch keeps cuBLAS's (docs/decisions/0005).
"""

from __future__ import annotations

import threading

import torch

from . import _compat

__all__ = [
    "bound_handle",
    "clear_workspaces",
    "cudnn_version",
    "frontend",
    "frontend_unavailable_reason",
    "release_handles",
    "workspace",
]

# Workspaces up to this size are kept per (device, stream) between calls; larger ones (a packed
# backward's dQ accumulator can take hundreds of MiB) come from the caching allocator each call.
_KEPT_WORKSPACE_BYTES = 64 << 20

_frontend = None
_frontend_error: str | None = None


def frontend():
    """The ``cudnn`` frontend module, or None when it cannot be imported (see :func:`frontend_unavailable_reason`)."""
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
    frontend()
    return _frontend_error


_cudnn_version: list = []


def cudnn_version() -> int | None:
    """The version of the cuDNN library the frontend loaded (``cudnn.backend_version()``, 91900 is 9.19.0), which runs
    the graphs (torch may have loaded another); None without a frontend or a library. Read once."""
    if not _cudnn_version:
        version = None
        if frontend() is not None:
            try:
                version = int(_frontend.backend_version())
            except Exception:  # noqa: BLE001 - no loadable libcudnn: no graph is built either
                version = None
        _cudnn_version.append(version)
    return _cudnn_version[0]


_thread_state = threading.local()


def bound_handle(device_index: int):
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
            entry = handles[device_index] = [frontend().create_handle(), None]
    stream = _compat.current_raw_stream(device_index)
    if entry[1] != stream:
        _frontend.set_stream(handle=entry[0], stream=stream)
        entry[1] = stream
    return entry[0], stream


# (device index, raw stream) -> uint8 buffer. Launches on one stream run in order, so one buffer
# serves them all; a stream torch hands out is never destroyed (it comes from a fixed pool), so a
# raw handle names the same queue for the life of the process.
_workspaces: dict = {}


def workspace(size: int, device: torch.device, stream: int):
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


def clear_workspaces() -> None:
    """Drop the kept workspaces (with the graph cache: a changed environment, tests)."""
    _workspaces.clear()


def release_handles() -> None:
    """Drop this thread's handles (at exit: see ``cudnn_graphs._release_at_exit``); other threads' die with them."""
    _thread_state.__dict__.pop("handles", None)
