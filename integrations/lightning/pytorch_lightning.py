"""The ``pytorch_lightning`` namespace's ``CudnnAttention`` and ``CudnnThroughputMonitor``.

The same classes as :mod:`cudnn_attention.integrations.lightning`, on ``pytorch_lightning``'s
bases: a Trainer rejects callbacks from the other namespace.
"""

from __future__ import annotations

from pytorch_lightning import Callback
from pytorch_lightning.callbacks import ThroughputMonitor

from ._switch import CudnnAttentionHooks
from ._throughput import PeakFlopsMixin

__all__ = ["CudnnAttention", "CudnnThroughputMonitor"]


class CudnnAttention(CudnnAttentionHooks, Callback):
    """Run attention on cuDNN for a ``pytorch_lightning`` Trainer; see :class:`cudnn_attention.integrations.lightning.CudnnAttention`.

    Args:
        strict: make every fallback from cuDNN raise while the trainer runs.
        provider: install the ``F.scaled_dot_product_attention``/``varlen_attn`` provider.
        hf_models: switch Hugging Face models to ``"cudnn"`` (and back).
        log_stats: log served/fallback counts to the trainer's loggers at each training epoch end.
    """


class CudnnThroughputMonitor(PeakFlopsMixin, ThroughputMonitor):
    """``ThroughputMonitor`` with the GPU's dense bf16 peak; see :class:`cudnn_attention.integrations.lightning.CudnnThroughputMonitor`."""
