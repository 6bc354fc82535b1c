"""Lightning integration: the ``CudnnAttention`` callback, a Fabric context manager, and MFU on any GPU.

- ``CudnnAttention`` (``lightning.pytorch``; the ``pytorch_lightning`` twin is in
  :mod:`.pytorch_lightning`): installs :func:`cudnn_attention.install` in ``setup``, switches
  Hugging Face models to ``attn_implementation="cudnn"`` (with
  :class:`cudnn_attention.integrations.hf.ModelSwitch`), restores everything in ``teardown`` /
  ``on_exception``. LightningCLI: ``--trainer.callbacks+=cudnn_attention.integrations.lightning.CudnnAttention``;
  unedited scripts: ``CUDNN_ATTENTION=1`` (entry points in :mod:`.factory`).
- :func:`fabric_attention`: the same switch as a context manager (or ``Fabric(callbacks=[CudnnAttention()])``).
- :func:`context_parallel_group`: the context-parallel group from ``ModelParallelStrategy``'s device mesh.
- ``CudnnThroughputMonitor`` / :func:`make_throughput`: tokens/s and MFU with the dense bf16 peak
  of :mod:`cudnn_attention.integrations.throughput` (Lightning's own table has none for an H200).

The Lightning classes are imported on first use, so importing this package (as the entry point
does for every Trainer) needs neither Lightning namespace.
"""

from __future__ import annotations

from ._switch import AttentionSwitch, CudnnAttentionHooks, fabric_attention
from ._throughput import make_throughput
from .context_parallel import context_parallel_group

__all__ = [
    "AttentionSwitch",
    "CudnnAttention",
    "CudnnAttentionHooks",
    "CudnnThroughputMonitor",
    "context_parallel_group",
    "fabric_attention",
    "make_throughput",
]

_LAZY = {"CudnnAttention": ".callback", "CudnnThroughputMonitor": ".throughput_monitor"}


def __getattr__(name: str):
    # PEP 562: ``lightning.pytorch`` is imported only when one of its classes is asked for.
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
