"""The versions a result depends on, as one dict: what a run records next to its figures so two runs can be told apart.

Example:
    >>> import cudnn_attention.environment
    >>> cudnn_attention.environment.versions()["gpu"]
    'cpu'

Framework-free: transformers and Lightning are looked up by their installed distributions (never imported), the cuDNN
frontend is imported only inside a ``try`` block, and CUDA is initialised only when a GPU is there to be named.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re

import torch

from .version import __version__

__all__ = ["TESTED", "untested_versions", "versions"]

# The releases the suite runs on (.ci/run: the newest and the floor of each) and the README's "Supported" line names, as
# (first, last) minor versions, inclusive: the one place they are written. A release outside them may work; nothing
# has checked it, and `cudnn-attention doctor` says so.
TESTED = {"torch": ("2.9", "2.15"), "transformers": ("5.17", "5.25")}


def _distribution_version(*names: str) -> str | None:
    """The installed version of the first distribution of ``names`` found, else ``None``."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _frontend() -> tuple[str | None, int | None]:
    """``(frontend version, version of the cuDNN library it loaded)``; ``None`` for what cannot be had here."""
    try:
        import cudnn
    except Exception:  # noqa: BLE001 - any import failure means "no usable frontend", which is what gets recorded
        return None, None
    frontend = getattr(cudnn, "__version__", None)
    # This is the cuDNN that runs the fused kernels, which can differ from the one torch was built against. Asking needs
    # no GPU (the frontend loads libcudnn and reads its version), so a login node reports what its jobs will load; with
    # a CPU build of torch and no nvidia-cudnn wheel there is no library to find.
    try:
        backend = int(cudnn.backend_version())
    except Exception:  # noqa: BLE001 - a missing or broken libcudnn is recorded as None, not raised
        backend = None
    return frontend, backend


def _torch_cudnn() -> int | None:
    """The cuDNN library torch loaded (``torch.backends.cudnn.version()``: None for a CPU build), GPU or not."""
    try:
        return torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - a CUDA build whose libcudnn does not load: recorded as None, not raised
        return None


def versions() -> dict:
    """The versions this process would run with, as a JSON-serialisable dict (``None`` for what is absent).

    Keys: ``cudnn_attention``, ``python``, ``torch``, ``cuda`` (the CUDA torch was built with; ``None`` for a CPU
    build), ``torch_cudnn`` (the cuDNN library torch loaded), ``cudnn_backend`` (the cuDNN library the frontend
    loaded), ``cudnn_frontend``, ``transformers``, ``lightning``, ``gpu`` (the name of the current CUDA device, or
    ``"cpu"``) and ``gpu_count``. Both cuDNN versions are read without a GPU too (``None`` where no library loads).
    """

    cuda = torch.cuda.is_available()
    frontend, backend = _frontend()
    return {
        "cudnn_attention": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_cudnn": _torch_cudnn(),
        "cudnn_backend": backend,
        "cudnn_frontend": frontend,
        "transformers": _distribution_version("transformers"),
        "lightning": _distribution_version("lightning", "pytorch-lightning"),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
    }


def _minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``"2.16.0a0+git1234"`` -> ``(2, 16)``), None when it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def untested_versions(found: dict | None = None) -> list[str]:
    """One line for each distribution of :data:`TESTED` whose installed version (in ``found``, default :func:`versions`)
    lies outside its tested range; none installed is nothing to say."""
    found = versions() if found is None else found
    lines = []
    for name, (low, high) in TESTED.items():
        version = found.get(name)
        minor = None if version is None else _minor(version)
        if minor is None or _minor(low) <= minor <= _minor(high):
            continue
        lines.append(
            f"{name} {version} is outside the versions this package is tested with ({low} to {high}): it may work, but nothing "
            f"has checked it; a release within them is the one to compare against"
        )
    return lines
