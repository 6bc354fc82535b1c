"""Recipe 3: packed fine-tuning with Lightning: a LightningModule around a Hugging Face model, ``CudnnAttention``, LightningCLI.

    python recipes/train_lightning.py                                     # mistral; a GPU: small/bf16-true, a CPU: tiny (fallback)
    python recipes/train_lightning.py --model.family=gpt_oss --compare=[eager,flex_attention]
    python recipes/train_lightning.py --trainer.devices=2 --trainer.strategy=ddp     # or --trainer.strategy=fsdp
    python recipes/train_lightning.py --help                               # every --model.* and --trainer.* flag

The module adds ``CudnnAttention`` (``configure_callbacks``) when it runs ``attn_implementation="cudnn"``: the callback
installs the provider on every rank before wrapping and keeps the model on "cudnn"; comparison runs with another
implementation go without it, so nothing reroutes them. Writes ``metrics.json`` and ``loss.png`` into
``--trainer.default_root_dir`` (default ``runs/train_lightning``).
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy

import cudnn_attention
from common.compare import run_with_compare
from common.config import data_budget, model_shape
from common.data import STATS_KEY, PackedCollator, build_dataset
from common.flops import step_flops_of
from common.model import build_model
from common.reporting import RunResult, finish, step_columns, step_row
from common.tokenizer import load_tokenizer
from cudnn_attention.integrations.lightning import CudnnAttention, make_throughput

__all__ = ["PackedCausalLM", "RecipeCLI", "RecipeReport", "main"]

RECIPE = "train_lightning"


class PackedCausalLM(LightningModule):
    """A causal LM trained on packed documents (one row per step, ``DataCollatorWithFlattening``).

    Args:
        family: ``mistral`` (sliding window), ``gpt_oss`` (sinks + alternating window) or ``llama``.
        size: ``tiny``, ``small``, ``1b-like``, ``long``; ``auto`` is resolved by the CLI (small on a GPU, tiny on a CPU).
        attn_implementation: ``cudnn`` (adds the ``CudnnAttention`` callback), ``eager``, ``sdpa``, ``flex_attention``.
        strict: make every fallback from cuDNN raise (the callback's ``strict``).
        lr: peak learning rate of the cosine schedule (10% warmup).
        tokens_per_step, min_doc_tokens, max_doc_tokens: the data budget (default: the size preset's).
        checkpoint, tokenizer, dataset, text_field: local model/tokenizer directories and a local .txt/.jsonl file.
        seed: model initialization and batch order.
    """

    def __init__(
        self,
        family: Literal["mistral", "gpt_oss", "llama"] = "mistral",
        size: Literal["auto", "tiny", "small", "1b-like", "long"] = "auto",
        attn_implementation: Literal["cudnn", "eager", "sdpa", "flex_attention"] = "cudnn",
        strict: bool = False,
        lr: float = 5e-4,
        tokens_per_step: int | None = None,
        min_doc_tokens: int | None = None,
        max_doc_tokens: int | None = None,
        checkpoint: str | None = None,
        tokenizer: str | None = None,
        dataset: str | None = None,
        text_field: str = "text",
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        if size == "auto":  # the CLI resolves it from the accelerator; a direct construction from the machine
            size = self.hparams.size = "small" if torch.cuda.is_available() else "tiny"
        budget = data_budget(size=size, tokens_per_step=tokens_per_step, min_doc_tokens=min_doc_tokens, max_doc_tokens=max_doc_tokens)
        self.tokens_per_step, self.min_doc_tokens, self.max_doc_tokens = budget.tokens_per_step, budget.min_doc_tokens, budget.max_doc_tokens
        self.tokenizer = load_tokenizer(tokenizer=tokenizer, checkpoint=checkpoint)
        self.hf = None  # built in configure_model: under Lightning's device/precision context, before FSDP wraps it
        self.step_flops = None
        self.last_counts: tuple = ()

    def configure_model(self) -> None:
        if self.hf is not None:
            return
        hp = self.hparams
        shape = None if hp.checkpoint else model_shape(family=hp.family, size=hp.size)
        self.hf = build_model(
            attn_implementation=hp.attn_implementation, family=hp.family, shape=shape, vocab_size=self.tokenizer.vocab_size,
            max_positions=max(4096, self.max_doc_tokens), checkpoint=hp.checkpoint, tokenizer=self.tokenizer,
            dtype=torch.get_default_dtype(),  # bf16 under precision="bf16-true"
            seed=hp.seed,
        )  # fmt: skip
        self.step_flops = step_flops_of(self.hf)

    def configure_callbacks(self) -> list[Callback]:
        callbacks = [RecipeReport()]
        if self.hparams.attn_implementation == "cudnn":
            callbacks.append(CudnnAttention(strict=self.hparams.strict))
        return callbacks

    def train_dataloader(self):
        dataset = build_dataset(
            tokenizer=self.tokenizer, dataset=self.hparams.dataset, text_field=self.hparams.text_field,
            tokens_per_step=self.tokens_per_step, min_doc_tokens=self.min_doc_tokens, max_doc_tokens=self.max_doc_tokens,
            seed=self.hparams.seed,
        )  # fmt: skip
        # One pack per step; Lightning swaps in a DistributedSampler under DDP/FSDP (each rank its own packs).
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return torch.utils.data.DataLoader(dataset, batch_size=1, shuffle=True, generator=generator, collate_fn=PackedCollator())

    def training_step(self, batch, batch_idx):
        self.last_counts = step_row(batch.pop(STATS_KEY), self.step_flops)
        loss = self.hf(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Lightning's FSDP precision plugin refuses to clip by norm (each rank holds only a shard, so a local norm
        # would be wrong); the FSDP root module computes the global norm across ranks.
        if isinstance(self.trainer.strategy, FSDPStrategy) and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def configure_optimizers(self):
        from transformers import get_cosine_schedule_with_warmup

        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        steps = self.trainer.max_steps
        schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=steps // 10, num_training_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class RecipeReport(Callback):
    """Per-step loss, wall time, tokens and FLOPs; tokens/s and MFU in the progress bar (``make_throughput``); a
    :class:`RunResult` gathered over ranks at the end (``self.result``)."""

    def __init__(self):
        self.result: RunResult | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.losses, self.counts, self.seconds = [], [], []
        self.throughput = make_throughput(world_size=trainer.world_size, device=trainer.strategy.root_device,
                                          window_size=max(2, min(10, trainer.max_steps // 2)))  # fmt: skip
        self._start = self._last = self._now(trainer)

    def _now(self, trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # time what ran, not what was queued
        return time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = self._now(trainer)
        self.seconds.append(now - self._last)
        self._last = now
        self.losses.append(outputs["loss"].detach())
        self.counts.append(pl_module.last_counts)
        steps = len(self.counts)
        tokens = sum(c[0] for c in self.counts)
        self.throughput.update(time=now - self._start, batches=steps, samples=steps, lengths=tokens,
                               flops=pl_module.last_counts[2] * trainer.world_size)  # fmt: skip
        metrics = self.throughput.compute()
        if "device/items_per_sec" in metrics:
            pl_module.log("tok/s", metrics["device/items_per_sec"] * trainer.world_size, prog_bar=True)
        if "device/mfu" in metrics:
            pl_module.log("mfu", metrics["device/mfu"], prog_bar=True)

    def on_train_end(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        losses = pl_module.all_gather(torch.stack(self.losses).float()).reshape(-1, len(self.losses)).mean(0)
        counts = pl_module.all_gather(torch.tensor(self.counts, dtype=torch.float64, device=device)).reshape(-1, len(self.counts), 4).sum(0)
        cuda = device.type == "cuda"
        self.result = RunResult(
            attn_implementation=pl_module.hparams.attn_implementation, losses=losses.tolist(), step_seconds=self.seconds,
            **step_columns(counts.tolist()), world_size=trainer.world_size,
            distributed=type(trainer.strategy).__name__,
            device_name=torch.cuda.get_device_name(device) if cuda else "cpu", peak_flops=self.throughput.available_flops,
            peak_memory_bytes=torch.cuda.max_memory_allocated(device) if cuda else None, stats=cudnn_attention.stats(),
        )  # fmt: skip


class RecipeCLI(LightningCLI):
    """LightningCLI with the recipe's defaults (one device, bf16-true on a GPU, no logger or checkpoints) and ``--compare``."""

    def add_arguments_to_parser(self, parser) -> None:
        implementation = Literal["eager", "sdpa", "flex_attention"]
        parser.add_argument("--compare", type=list[implementation] | implementation, default=[],
                            help="also run the same steps with these implementations: --compare=eager, --compare=[eager,sdpa]")

    def before_instantiate_classes(self) -> None:
        config = self.config
        on_gpu = torch.cuda.is_available() and config.trainer.accelerator not in ("cpu",)
        if config.model.size == "auto":
            config.model.size = "small" if on_gpu else "tiny"
        if config.trainer.max_steps in (None, -1):
            config.trainer.max_steps = data_budget(size=config.model.size).steps
        if config.trainer.precision is None:
            config.trainer.precision = "bf16-true" if on_gpu else "32-true"


def _cli(argv: list[str]) -> RecipeCLI:
    import sys

    defaults = {
        "devices": 1, "logger": False, "enable_checkpointing": False, "enable_model_summary": False, "default_root_dir": f"runs/{RECIPE}",
        "gradient_clip_val": 1.0, "num_sanity_val_steps": 0, "log_every_n_steps": 1,
    }  # fmt: skip
    # LightningCLI warns when it gets args= while sys.argv holds arguments too; here args= is the command line (plus the
    # comparison's override), so hide sys.argv while it parses. Restored before fit: DDP's launcher re-runs sys.argv.
    script_argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return RecipeCLI(
            PackedCausalLM, trainer_defaults=defaults, seed_everything_default=0, save_config_callback=None, run=False, args=argv
        )
    finally:
        sys.argv = script_argv


def main(argv: list[str] | None = None) -> dict:
    """Fit (and compare), then on rank zero print the summary and write ``metrics.json`` and ``loss.png``; returns the metrics."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    first = _cli(argv)
    compare = first.config.compare
    primary, references = first.model.hparams.attn_implementation, [compare] if isinstance(compare, str) else list(compare)

    def run_once(implementation: str) -> RunResult:
        # run_with_compare runs each implementation once, the primary first: the CLI already parsed serves it.
        cli = first if implementation == primary else _cli([*argv, f"--model.attn_implementation={implementation}"])
        cli.trainer.fit(cli.model)
        report = next(c for c in cli.trainer.callbacks if isinstance(c, RecipeReport))
        return report.result

    device = "cuda" if first.trainer.strategy.root_device.type == "cuda" else "cpu"
    if primary == "cudnn" and device == "cpu" and first.trainer.is_global_zero:
        print("no GPU: cudnn_attention serves every attention call on its exact PyTorch fallback (counted below); cuDNN needs a GPU")
    results = run_with_compare(run_once, primary=primary, references=references, device=device)
    hp = first.model.hparams
    config = {**dict(hp), "size": hp.size, "steps": first.trainer.max_steps, "precision": str(first.trainer.precision),
              "tokens_per_step": first.model.tokens_per_step, "compare": references}  # fmt: skip
    title = f"{RECIPE}: {hp.checkpoint or f'{hp.family} {hp.size}'}"
    return finish(recipe=RECIPE, results=results, primary=primary, config=config,
                  output_dir=first.trainer.default_root_dir, title=title, write=first.trainer.is_global_zero)  # fmt: skip


if __name__ == "__main__":
    main()
