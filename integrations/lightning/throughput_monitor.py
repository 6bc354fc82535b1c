"""``CudnnThroughputMonitor`` for ``lightning.pytorch``: Lightning's ``ThroughputMonitor`` with the GPU's dense bf16 peak."""

from __future__ import annotations

from lightning.pytorch.callbacks import ThroughputMonitor

from ._throughput import PeakFlopsMixin

__all__ = ["CudnnThroughputMonitor"]


class CudnnThroughputMonitor(PeakFlopsMixin, ThroughputMonitor):
    """``ThroughputMonitor`` that reports MFU on GPUs Lightning's table misses (an H200 among them).

    Args:
        batch_size_fn: samples in a batch.
        length_fn: tokens in a batch (then ``items_per_sec`` is tokens/s).
        available_flops: peak FLOP/s per device, overriding :mod:`cudnn_attention.integrations.throughput`'s table.
        **kwargs: ``Throughput``'s (``window_size``, ``separator``).

    Example:
        >>> monitor = CudnnThroughputMonitor(batch_size_fn=lambda b: b.size(0), length_fn=lambda b: b.numel())
        >>> Trainer(precision="bf16-mixed", callbacks=[monitor], log_every_n_steps=10)  # logs train/device/mfu
    """
