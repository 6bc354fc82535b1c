"""Recipe 3: packed fine-tuning with Lightning: a LightningModule around a Hugging Face model, ``CudnnAttention``, LightningCLI.

    python3 recipes/train_lightning.py                                     # mistral; a GPU: small/bf16-true, a CPU: tiny (fallback)
    python3 recipes/train_lightning.py --model.family=gpt_oss --compare=[eager,flex_attention]
    python3 recipes/train_lightning.py --trainer.devices=2 --trainer.strategy=ddp     # or --trainer.strategy=fsdp
    python3 recipes/train_lightning.py --help                               # every --model.* and --trainer.* flag

The module adds ``CudnnAttention`` (``configure_callbacks``) when it runs ``attn_implementation="cudnn"``: the callback
installs the provider on every rank before wrapping and keeps the model on "cudnn"; comparison runs with another
implementation go without it, so nothing reroutes them. The ``--model.*`` flags are the Trainer recipes' own
(``RecipeOptions``) plus ``--model.lr`` and ``--model.seed``. Each run writes ``metrics.json`` and ``loss.png`` into a
folder of its own, ``runs/train_lightning/<date>_<time>/``, or into ``--trainer.default_root_dir`` (where Lightning also
puts its logs and checkpoints when they are turned on); ``--overwrite_output_dir`` lets a run replace a finished one there.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cudnn_attention.recipes.common.compare import run_with_compare
from cudnn_attention.recipes.common.config import (
    LEARNING_RATE,
    MAX_GRAD_NORM,
    WARMUP_SHARE,
    WEIGHT_DECAY,
    RecipeOptions,
    Reference,
    RunOptions,
    check_machine,
    check_strict,
    document_fields,
    help_of,
    model_shape,
)
from cudnn_attention.recipes.common.data import STATS_KEY, PackedCollator, PackedDataset, build_dataset
from cudnn_attention.recipes.common.errors import (
    RecipeError,
    command_name,
    flag,
    flag_spelling,
    missing_extra,
    option_strings,
    run_command,
    trainer_flag,
    usage_error,
)
from cudnn_attention.recipes.common.flops import step_flops_of
from cudnn_attention.recipes.common.model import build_model
from cudnn_attention.recipes.common.reporting import RunResult, announce_run, fallback_announced, finish, format_mfu, format_rate
from cudnn_attention.recipes.common.run_dirs import checked_output_dir, new_run_dir, remove_empty_dirs
from cudnn_attention.recipes.common.steps import StepRecorder
from cudnn_attention.recipes.common.tokenizer import load_tokenizer

try:
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
    from lightning.pytorch.strategies import FSDPStrategy

    from cudnn_attention.integrations.lightning import CudnnAttention
except ModuleNotFoundError as error:
    if __name__ != "__main__" or missing_extra(error) is None:
        raise
    # Run as a command without the lightning extra: the one line run_command gives other mistakes (the classes below
    # need Lightning, so this cannot wait for main).
    print(f"{command_name()}: error: {missing_extra(error)}", file=sys.stderr)
    raise SystemExit(2) from None

__all__ = ["LightningOptions", "PackedCausalLM", "RecipeCLI", "RecipeProgressBar", "RecipeReport", "lightning_flag", "main"]

RECIPE = "train_lightning"
# The Trainer recipes' names (what the shared pieces' messages use) of the options this recipe takes from Lightning's
# Trainer or under another name; the other recipe options are --model.<name>, and --compare/--overwrite_output_dir are
# the same in both.
_LIGHTNING_NAMES = {"output_dir": "trainer.default_root_dir", "max_steps": "trainer.max_steps", "learning_rate": "model.lr"}


@document_fields
@dataclass(kw_only=True)
class LightningOptions(RecipeOptions):
    """:class:`RecipeOptions` plus what the Trainer recipes take from ``TrainingArguments`` (``--learning_rate``, ``--seed``)."""

    lr: float = field(
        default=LEARNING_RATE,
        metadata={"help": "peak learning rate (AdamW, cosine schedule after a linear warmup over the first tenth of the steps)"},
    )
    seed: int = field(default=0, metadata={"help": "seed of the model init and the batch order (the same in compare runs)"})


def lightning_flag(name: str, value: object = None) -> str:
    """Option ``name`` (a Trainer recipe's name) as this recipe's command line takes it: ``--model.tokens_per_step=2048``,
    ``--trainer.default_root_dir``; the spelling :func:`~cudnn_attention.recipes.common.errors.flag` gives inside :func:`main`."""
    fields = {f.name for f in dataclasses.fields(LightningOptions)}
    spelled = _LIGHTNING_NAMES.get(name) or (f"model.{name}" if name in fields else None)
    if spelled is None:
        return trainer_flag(name, value)
    return f"--{spelled}" if value is None else f"--{spelled}={value}"


class PackedCausalLM(LightningModule):
    """A causal LM trained on packed documents (one row per step, ``DataCollatorWithFlattening``); ``attn_implementation="cudnn"``
    adds the ``CudnnAttention`` callback.

    Takes the fields of :class:`LightningOptions` as keyword arguments (LightningCLI finds them, with their help, in
    ``LightningOptions``, to which they are passed); ``self.options`` holds them resolved against the size preset.
    """

    def __init__(self, **options):
        super().__init__()
        self.save_hyperparameters()
        given = LightningOptions(**options)
        # size="auto": the CLI resolves it from the accelerator; a direct construction resolves it from the machine.
        self.options = given.resolved(on_gpu=torch.cuda.is_available())
        self.tokenizer = load_tokenizer(tokenizer=self.options.tokenizer, checkpoint=self.options.checkpoint)
        self.hf = None  # built in configure_model: under Lightning's device/precision context, before FSDP wraps it
        self.step_flops = None
        self.step_counts: dict | None = None  # the collator's counts of the batch in training_step, for RecipeReport
        self._dataset: PackedDataset | None = None

    def packed_dataset(self) -> PackedDataset:
        """The packs this module trains on (built on first use)."""
        if self._dataset is None:
            o = self.options
            self._dataset = build_dataset(
                tokenizer=self.tokenizer,
                dataset=o.dataset,
                text_field=o.text_field,
                tokens_per_step=o.tokens_per_step,
                min_doc_tokens=o.min_doc_tokens,
                max_doc_tokens=o.max_doc_tokens,
                seed=o.seed,
            )
        return self._dataset

    def configure_model(self) -> None:
        if self.hf is not None:
            return
        o = self.options
        shape = None if o.checkpoint else model_shape(family=o.family, size=o.size)
        self.hf = build_model(
            attn_implementation=o.attn_implementation,
            family=o.family,
            shape=shape,
            vocab_size=self.tokenizer.vocab_size,
            max_positions=max(4096, o.max_doc_tokens),
            checkpoint=o.checkpoint,
            tokenizer=self.tokenizer,
            dtype=torch.get_default_dtype(),  # bf16 under precision="bf16-true"
            seed=o.seed,
        )
        self.step_flops = step_flops_of(self.hf)

    def configure_callbacks(self) -> list[Callback]:
        callbacks = [RecipeReport()]
        if self.options.attn_implementation == "cudnn":
            callbacks.append(CudnnAttention(strict=self.options.strict))
        return callbacks

    def train_dataloader(self):
        # One pack per step; Lightning swaps in a DistributedSampler under DDP/FSDP (each rank its own packs).
        generator = torch.Generator().manual_seed(self.options.seed)
        return torch.utils.data.DataLoader(
            self.packed_dataset(), batch_size=1, shuffle=True, generator=generator, collate_fn=PackedCollator()
        )

    def training_step(self, batch, batch_idx):
        self.step_counts = batch.pop(STATS_KEY)
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

        optimizer = torch.optim.AdamW(self.parameters(), lr=self.options.lr, weight_decay=WEIGHT_DECAY)
        steps = self.trainer.max_steps
        schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=int(steps * WARMUP_SHARE), num_training_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class RecipeReport(Callback):
    """Feeds a :class:`StepRecorder` from Lightning's hooks: tokens/s and MFU in the progress bar (the summary's figures so
    far), and a :class:`RunResult` gathered over ranks at the end (``self.result``)."""

    def __init__(self):
        self.recorder: StepRecorder | None = None
        self.result: RunResult | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.recorder = StepRecorder(
            step_flops=pl_module.step_flops,
            device=trainer.strategy.root_device,
            planned_steps=trainer.max_steps,
            world_size=trainer.world_size,
        )
        self._steps = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.recorder.begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.recorder.add_batch(pl_module.step_counts, outputs["loss"])
        if trainer.global_step == self._steps:
            return  # gradient accumulation: the optimizer step comes with a later batch
        self._steps = trainer.global_step
        self.recorder.end_step()
        live = self.recorder.live()
        if live["tokens_per_s"]:
            pl_module.log("tok/s", live["tokens_per_s"], prog_bar=True)
        if live["mfu"] is not None:
            pl_module.log("mfu", live["mfu"], prog_bar=True)

    def on_train_end(self, trainer, pl_module) -> None:
        self.result = self.recorder.result(
            attn_implementation=pl_module.options.attn_implementation,
            gather=lambda t: pl_module.all_gather(t).reshape(-1, *t.shape),
            distributed=type(trainer.strategy).__name__,
        )


class RecipeProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar with tokens/s and MFU printed as the summary prints them.

    The recipe trains for a number of steps, not epochs; Lightning's rich bar shows that as ``Epoch 0/-2``.
    """

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        if "tok/s" in metrics:
            metrics["tok/s"] = format_rate(metrics["tok/s"])
        if "mfu" in metrics:
            metrics["mfu"] = format_mfu(metrics["mfu"])
        return metrics


class RecipeCLI(LightningCLI):
    """LightningCLI with the recipe's defaults (one device, bf16-true on a GPU, no logger or checkpoints, a folder per run)
    and the flags every recipe takes (``--compare``, ``--overwrite_output_dir``)."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--compare",
            type=list[Reference] | Reference,
            default=[],
            help=f"{help_of(RunOptions, 'compare')}: --compare=eager, --compare=[eager,sdpa]",
        )
        # nargs="?": a bare --overwrite_output_dir means true, as in the Trainer recipes (--overwrite_output_dir=false still works).
        parser.add_argument(
            "--overwrite_output_dir", type=bool, nargs="?", const=True, default=False, help=help_of(RunOptions, "overwrite_output_dir")
        )

    def before_instantiate_classes(self) -> None:
        config = self.config
        on_gpu = torch.cuda.is_available() and config.trainer.accelerator not in ("cpu",)
        options = LightningOptions(**config.model.as_dict()).resolved(on_gpu=on_gpu)
        config.model.size = options.size
        device = "cuda:0" if on_gpu else "cpu"
        check_machine(size=options.size, tokens_per_step=options.tokens_per_step, device=device)
        check_strict(strict=options.strict, device=device)
        if config.trainer.max_steps in (None, -1):
            config.trainer.max_steps = options.budget().steps
        elif config.trainer.max_steps < 1:
            raise RecipeError(f"{flag('max_steps', config.trainer.max_steps)}: pass 1 or more (default: the size preset's, -1 the same)")
        if config.trainer.precision is None:
            config.trainer.precision = "bf16-true" if on_gpu else "32-true"
        if config.trainer.default_root_dir is None:
            # Named here on every rank and created by main() on rank zero once the module is built (a bad flag then leaves
            # no folder); the other ranks write nothing there (Lightning hands its checkpoint folder from rank zero).
            config.trainer.default_root_dir = str(new_run_dir(RECIPE, create=False))
            self.keep = Path.cwd()
        else:
            _, self.keep = checked_output_dir(config.trainer.default_root_dir, overwrite=config.overwrite_output_dir)
        callbacks = config.trainer.callbacks or []
        chosen_bar = any("ProgressBar" in str(getattr(callback, "class_path", callback)) for callback in callbacks)
        if config.trainer.enable_progress_bar is not False and not chosen_bar:
            self.trainer_defaults["callbacks"] = [RecipeProgressBar()]


class RecipeArgumentParser(LightningArgumentParser):
    """LightningCLI's parser with one-line errors: its usage block runs to some sixty lines of ``--trainer.*`` flags."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # a parser asked to raise (jsonargparse's inner parsers, a caller's) keeps doing so
            return super().error(message, ex)
        usage_error(self.prog, message, options=option_strings(self))


def _cli(argv: list[str]) -> RecipeCLI:
    defaults = {
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "gradient_clip_val": MAX_GRAD_NORM,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
    }
    # LightningCLI warns when it gets args= while sys.argv holds arguments too; here args= is the command line (plus the
    # comparison's override), so hide sys.argv while it parses. Restored before fit: DDP's launcher re-runs sys.argv.
    script_argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return RecipeCLI(
            PackedCausalLM,
            trainer_defaults=defaults,
            seed_everything_default=0,
            save_config_callback=None,
            run=False,
            args=argv,
            parser_class=RecipeArgumentParser,
        )
    finally:
        sys.argv = script_argv


def main(argv: list[str] | None = None) -> dict:
    """Fit (and compare), then on rank zero print the summary and write ``metrics.json`` and ``loss.png``; returns the metrics.

    Its mistakes (:class:`~cudnn_attention.recipes.common.errors.RecipeError`) name flags as this recipe spells them."""
    with flag_spelling(lightning_flag):
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> dict:
    first = _cli(argv)
    trainer, options = first.trainer, first.model.options
    compare = first.config.compare
    primary, references = options.attn_implementation, [compare] if isinstance(compare, str) else list(compare)
    root, device = Path(trainer.default_root_dir), trainer.strategy.root_device
    try:
        packs = first.model.packed_dataset().packs
        if trainer.is_global_zero:
            root.mkdir(parents=True, exist_ok=True)
            announce_run(
                recipe=RECIPE,
                options=options,
                implementation=primary,
                device=device,
                steps=trainer.max_steps,
                packs=packs,
                packs_per_step=trainer.accumulate_grad_batches,
                world_size=trainer.world_size,
            )  # one pack per batch

        def run_once(implementation: str) -> RunResult:
            # run_with_compare runs each implementation once, the primary first: the CLI already parsed serves it.
            cli = (
                first
                if implementation == primary
                else _cli([*argv, f"--model.attn_implementation={implementation}", f"--trainer.default_root_dir={root}"])
            )
            with fallback_announced(device=str(device)):
                cli.trainer.fit(cli.model)
            return next(c for c in cli.trainer.callbacks if isinstance(c, RecipeReport)).result

        results = run_with_compare(run_once, primary=primary, references=references, device=str(device))
        config = {
            **dataclasses.asdict(options),
            "steps": trainer.max_steps,
            "precision": str(trainer.precision),
            "compare": references,
            "output_dir": str(root),
        }
        return finish(
            recipe=RECIPE,
            results=results,
            primary=primary,
            config=config,
            output_dir=root,
            title=f"{RECIPE}: {options.model_name()}",
            write=trainer.is_global_zero,
        )
    finally:
        if trainer.is_global_zero:
            remove_empty_dirs(root, keep=first.keep)


if __name__ == "__main__":
    with flag_spelling(lightning_flag):  # also for what run_command prints after main has returned
        run_command(main)
