"""The engine of the Trainer recipes: packed fine-tuning with transformers' ``Trainer``, measured and optionally compared.

Works unchanged under ``accelerate launch`` (DDP or FSDP): every rank trains on its own packs
(per-device token budget), per-step counts are gathered at the end, and only rank zero prints and
writes files.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

import cudnn_attention

from .compare import run_with_compare
from .config import RecipeConfig, model_shape, parse_config
from .data import STATS_KEY, PackedCollator, build_dataset
from .flops import step_flops_of
from .model import build_model
from .reporting import RunResult, finish, step_columns, step_row
from .tokenizer import load_tokenizer

__all__ = ["main", "run", "train_once"]


def _is_rank_zero() -> bool:
    # accelerate launch and torchrun set RANK for every process; a plain `python` run has none.
    return os.environ.get("RANK", "0") == "0"


def _trainer_classes():
    """``Trainer`` subclass and callback, defined on first use so that importing this module does not import transformers' trainer."""
    from transformers import Trainer, TrainerCallback

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step, data loading included (what a user waits for)."""

        def __init__(self, cuda: bool):
            self.cuda, self.seconds, self._last = cuda, [], None

        def _now(self) -> float:
            if self.cuda:
                torch.cuda.synchronize()  # kernels are queued asynchronously: time what ran, not what was queued
            return time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            if self._last is None:
                self._last = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            now = self._now()
            self.seconds.append(now - self._last)
            self._last = now

    class PackedTrainer(Trainer):
        """Pops the collator's per-step counts before the model call and keeps each step's loss, tokens and FLOPs."""

        def __init__(self, *args, step_flops, clock, peak_flops, **kwargs):
            super().__init__(*args, **kwargs)
            self.step_flops, self.clock, self.peak_flops = step_flops, clock, peak_flops
            self.step_losses: list[torch.Tensor] = []
            self.step_counts: list[tuple[float, float, float, float]] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.step_counts.append(step_row(inputs.pop(STATS_KEY), self.step_flops))
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.step_losses.append(loss)  # a device tensor: reading it now would synchronize every step
            return loss

        def log(self, logs, start_time=None):
            # Live throughput in the progress output, from this rank's counts (the final figures gather all ranks).
            seconds = sum(self.clock.seconds)
            if "loss" in logs and seconds > 0:
                done = self.step_counts[: len(self.clock.seconds)]
                logs["tokens_per_s"] = round(sum(c[0] for c in done) * self.args.world_size / seconds)
                if self.peak_flops:
                    logs["mfu"] = round(sum(c[2] for c in done) / seconds / self.peak_flops, 4)
            super().log(logs, start_time)

        def gathered(self) -> tuple[list[float], list[tuple]]:
            """Per-step losses averaged over ranks (each rank's loss is its share of the global token mean, times
            the world size) and per-step counts summed over ranks."""
            device = self.args.device
            losses = torch.stack(self.step_losses).float().to(device)[None]
            counts = torch.tensor(self.step_counts, dtype=torch.float64, device=device)[None]
            losses, counts = self.accelerator.gather(losses).mean(0), self.accelerator.gather(counts).sum(0)
            return losses.tolist(), [tuple(row) for row in counts.tolist()]

    return PackedTrainer, StepClock


def train_once(config: RecipeConfig, implementation: str, *, dataset, tokenizer, output_dir: Path) -> RunResult:
    """Train ``config.steps`` steps with ``implementation`` from the seed's initial weights; return what was measured."""
    from transformers import TrainingArguments

    from cudnn_attention.throughput import dense_bf16_peak_flops

    PackedTrainer, StepClock = _trainer_classes()
    cuda = str(config.device).startswith("cuda")
    shape = None if config.checkpoint else model_shape(family=config.model, size=config.size)
    model = build_model(
        attn_implementation=implementation, family=config.model, shape=shape, vocab_size=tokenizer.vocab_size,
        max_positions=max(4096, config.max_doc_tokens), checkpoint=config.checkpoint, tokenizer=tokenizer, device=config.device,
        dtype=config.dtype, seed=config.seed,
    )  # fmt: skip
    step_flops = step_flops_of(model)  # before any wrapping (FSDP shards the parameters)
    args = TrainingArguments(
        output_dir=str(output_dir / f"trainer-{implementation}"), max_steps=config.steps, per_device_train_batch_size=1,
        learning_rate=config.lr, lr_scheduler_type="cosine", warmup_steps=config.steps // 10, weight_decay=0.1,
        logging_steps=max(1, config.steps // 10), save_strategy="no", report_to="none", remove_unused_columns=False,
        bf16=cuda, use_cpu=not cuda, seed=config.seed, dataloader_pin_memory=cuda,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient every step; skip DDP's graph walk
    )  # fmt: skip
    clock = StepClock(cuda)
    peak_flops = dense_bf16_peak_flops(args.device) if cuda else None
    trainer = PackedTrainer(model=model, args=args, train_dataset=dataset, data_collator=PackedCollator(), callbacks=[clock],
                            step_flops=step_flops, clock=clock, peak_flops=peak_flops)  # fmt: skip
    with cudnn_attention.strict() if config.strict else contextlib.nullcontext():
        trainer.train()
    losses, counts = trainer.gathered()
    result = RunResult(
        attn_implementation=implementation, losses=losses, step_seconds=list(clock.seconds), **step_columns(counts), world_size=args.world_size, distributed=_distributed(trainer), device_name=torch.cuda.get_device_name() if cuda else "cpu",
        peak_flops=peak_flops,
        peak_memory_bytes=torch.cuda.max_memory_allocated() if cuda else None, stats=cudnn_attention.stats(),
    )  # fmt: skip
    return result


def _distributed(trainer) -> str:
    kind = trainer.accelerator.distributed_type.value  # "NO", "MULTI_GPU", "FSDP", ...
    return {"NO": "single process", "MULTI_GPU": "DDP", "MULTI_CPU": "DDP"}.get(kind, kind) + (
        f" v{trainer.accelerator.state.fsdp_plugin.fsdp_version}" if kind == "FSDP" else ""
    )


def run(config: RecipeConfig, *, recipe: str) -> dict:
    """Train (and compare), then on rank zero print the summary and write ``metrics.json`` and ``loss.png``; returns the metrics."""
    config = config.resolved()
    if str(config.device).startswith("cuda") and torch.device(config.device).index is not None:
        torch.cuda.set_device(torch.device(config.device))  # memory figures and the device name refer to it
    output_dir = Path(config.output_dir or Path("runs") / recipe)
    tokenizer = load_tokenizer(tokenizer=config.tokenizer, checkpoint=config.checkpoint)
    dataset = build_dataset(
        tokenizer=tokenizer, dataset=config.dataset, text_field=config.text_field, tokens_per_step=config.tokens_per_step,
        min_doc_tokens=config.min_doc_tokens, max_doc_tokens=config.max_doc_tokens, seed=config.seed,
    )  # fmt: skip
    rank_zero = _is_rank_zero()
    if rank_zero:
        documents = sum(len(pack) for pack in dataset.packs)
        model = config.checkpoint or f"random-init {config.model} ({config.size})"
        print(f"{recipe}: {model}, attn_implementation={config.attn!r}, {config.device}, {config.steps} steps of "
              f"{config.tokens_per_step:,} tokens per device ({len(dataset)} packs, {documents / len(dataset):.1f} documents each, "
              f"{config.min_doc_tokens}-{config.max_doc_tokens} tokens per document)")  # fmt: skip
        if config.attn == "cudnn" and not str(config.device).startswith("cuda"):
            print("no GPU: cudnn_attention serves every attention call on its exact PyTorch fallback (counted below); cuDNN needs a GPU")
    results = run_with_compare(
        lambda implementation: train_once(config, implementation, dataset=dataset, tokenizer=tokenizer, output_dir=output_dir),
        primary=config.attn, references=config.compare, device=config.device,
    )  # fmt: skip
    title = f"{recipe}: {config.checkpoint or f'{config.model} {config.size}'}"
    return finish(recipe=recipe, results=results, primary=config.attn, config=dict(vars(config)),
                  output_dir=output_dir, title=title, write=rank_zero)  # fmt: skip


def main(argv: list[str] | None = None, *, recipe: str, model: str) -> dict:
    """Command-line entry of a Trainer recipe: ``model`` is the recipe's default family."""
    return run(parse_config(argv, model=model), recipe=recipe)
