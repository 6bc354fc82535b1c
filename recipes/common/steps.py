"""What each training step measured, the same way under every engine: one clock, one live rate, one gather.

The Trainer recipes and the Lightning recipe feed a :class:`StepRecorder` from their own hooks (a batch went in,
an optimizer step ended); it keeps each step's wall time, loss, tokens and FLOPs, gives the progress bar the
tokens/s the final summary will report, and assembles the :class:`~.reporting.RunResult` over all ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import cudnn_attention
from cudnn_attention.integrations.throughput import dense_bf16_peak_flops

from .reporting import RunResult, rates, step_columns, step_row, warmup_steps

__all__ = ["StepRecorder"]


class StepRecorder:
    """Per-step measurements of one training run on one rank.

    Args:
        step_flops: the model's :class:`~.flops.StepFlops` (FLOPs of a step's documents).
        device: the rank's device; on a GPU the clock synchronizes, so a step's time is what ran, not what was queued.
        planned_steps: the run's optimizer steps (the warm-up steps left out of the rate depend on it).
        world_size: ranks training together; each packs the same tokens per step.

    MFU is against the GPU's dense bf16 peak (``cudnn_attention.integrations.throughput``; none on a CPU or an unknown GPU).

    Example:
        >>> recorder = StepRecorder(step_flops=flops, device=device, planned_steps=200, world_size=1)
        >>> recorder.add_batch(batch.pop(STATS_KEY), loss)   # each (micro-)batch, after its backward
        >>> recorder.end_step()                               # each optimizer step
        >>> recorder.live()["tokens_per_s"]                   # what the summary will say, so far
    """

    def __init__(self, *, step_flops, device: torch.device, planned_steps: int, world_size: int):
        self.step_flops, self.device, self.planned_steps, self.world_size = step_flops, torch.device(device), planned_steps, world_size
        self.peak_flops = dense_bf16_peak_flops(self.device)
        self.seconds: list[float] = []
        self.losses: list[torch.Tensor] = []  # device tensors: reading one now would synchronize every step
        self.rows: list[tuple[float, float, float, float]] = []  # step_row per optimizer step
        self._last: float | None = None
        self._batch_rows: list[tuple] = []
        self._batch_loss: torch.Tensor | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin(self) -> None:
        """Start the clock (before the first step; later calls do nothing)."""
        if self._last is None:
            self._last = self._now()

    def add_batch(self, counts: dict, loss: torch.Tensor) -> None:
        """One (micro-)batch: the collator's counts and the loss the engine reports for it (normalized by gradient accumulation,
        so a step's loss is the sum over its micro-batches)."""
        self._batch_rows.append(step_row(counts, self.step_flops))
        loss = loss.detach().float()
        self._batch_loss = loss if self._batch_loss is None else self._batch_loss + loss

    def end_step(self) -> None:
        """One optimizer step ended: its wall time since the previous step ended (data loading included)."""
        now = self._now()
        self.seconds.append(now - (self._last if self._last is not None else now))
        self._last = now
        self.rows.append(tuple(sum(column) for column in zip(*self._batch_rows, strict=True)))
        self.losses.append(self._batch_loss)
        self._batch_rows, self._batch_loss = [], None

    def live(self) -> dict:
        """``{"tokens_per_s", "mfu"}`` over the steps so far on this rank's clock, leaving out the warm-up steps the summary leaves
        out (all steps until there are more): at the last step, the summary's figures."""
        done = len(self.seconds)
        skip = min(warmup_steps(self.planned_steps), max(done - 1, 0))
        tokens = [row[0] * self.world_size for row in self.rows]  # every rank packs the same tokens per step
        flops = [row[2] * self.world_size for row in self.rows]
        tokens_per_s, mfu = rates(self.seconds, tokens, flops, skip=skip, peak_flops=self.peak_flops, world_size=self.world_size)
        return {"tokens_per_s": tokens_per_s, "mfu": mfu}

    def result(self, *, attn_implementation: str, gather: Callable[[torch.Tensor], torch.Tensor], distributed: str) -> RunResult:
        """The run's :class:`RunResult`: losses averaged and counts summed over ranks (``gather(t)`` stacks every rank's ``t``
        along a new first dimension), this rank's step times, memory and ``cudnn_attention.stats()``."""
        losses = gather(torch.stack(self.losses).to(self.device)).mean(0)
        counts = gather(torch.tensor(self.rows, dtype=torch.float64, device=self.device)).sum(0)
        cuda = self.device.type == "cuda"
        return RunResult(
            attn_implementation=attn_implementation,
            losses=losses.tolist(),
            step_seconds=list(self.seconds),
            **step_columns(counts.tolist()),
            world_size=self.world_size,
            distributed=distributed,
            device_name=torch.cuda.get_device_name(self.device) if cuda else "cpu",
            peak_flops=self.peak_flops,
            peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else None,
            stats=cudnn_attention.stats(),
        )
