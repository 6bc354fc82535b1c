"""Tokens/s and MFU with the GPU's dense bf16 peak, on Lightning's own ``Throughput`` math.

No Lightning import at module level: :class:`PeakFlopsMixin` is mixed into each namespace's
``ThroughputMonitor`` (``throughput_monitor.py`` / ``pytorch_lightning.py``), and
:func:`make_throughput` imports ``lightning.fabric`` when called.
"""

from __future__ import annotations

from ..throughput import dense_bf16_peak_flops
from . import _compat

__all__ = ["PeakFlopsMixin", "make_throughput"]

# Trainer precisions whose matmuls run in bf16/fp16, the only ones the dense bf16 peak describes.
_HALF_PRECISION_PREFIXES = ("bf16", "16")


def make_throughput(
    *, world_size: int = 1, window_size: int = 100, device=None, available_flops: float | None = None, separator: str = "/"
):
    """A ``lightning.fabric.utilities.throughput.Throughput`` that knows the dense bf16 peak of ``device``.

    For Fabric loops and plain scripts (recipes). ``available_flops`` overrides the table.

    Example:
        >>> throughput = make_throughput(world_size=fabric.world_size)
        >>> # running totals, except flops: those of the batches since the previous update
        >>> throughput.update(time=elapsed, batches=step, samples=step * batch, lengths=step * batch * seq, flops=flops_per_batch)
        >>> throughput.compute()["device/mfu"], throughput.compute()["device/items_per_sec"]  # items = tokens
    """
    from lightning.fabric.utilities.throughput import Throughput

    peak = dense_bf16_peak_flops(device, override=available_flops)
    return Throughput(available_flops=peak, world_size=world_size, window_size=window_size, separator=separator)


class PeakFlopsMixin:
    """Gives a ``ThroughputMonitor`` the dense bf16 peak from :mod:`cudnn_attention.integrations.throughput`.

    Lightning's monitor looks the peak up by device name and finds none for an H200, so it logs
    no MFU there. After the monitor's own ``setup`` this sets ``available_flops`` on each of its
    ``Throughput`` objects, when the trainer computes in bf16/fp16 (a bf16 peak says nothing about
    fp32 matmuls) or when ``available_flops`` was given. ``items_per_sec`` is tokens/s when
    ``length_fn`` returns tokens per batch.
    """

    def __init__(self, batch_size_fn, length_fn=None, *, available_flops: float | None = None, **kwargs):
        super().__init__(batch_size_fn, length_fn, **kwargs)
        self._peak_override = available_flops

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        peak = self._peak_override
        if peak is None and str(trainer.precision).startswith(_HALF_PRECISION_PREFIXES):
            peak = dense_bf16_peak_flops(trainer.strategy.root_device)
        if peak is None:
            return  # keep Lightning's figure (or its absence)
        self.available_flops = peak
        # The monitor built its Throughput objects in setup; available_flops is their public field.
        for throughput in _compat.monitor_throughputs(self):
            throughput.available_flops = peak
