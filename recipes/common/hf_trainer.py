"""The engine of the Trainer recipes: packed fine-tuning with transformers' ``Trainer``, measured and optionally compared.

Every ``TrainingArguments`` flag passes through (``--report_to tensorboard``, ``--gradient_checkpointing``,
``--save_strategy steps``, ``--torch_compile``, ...) next to the recipe's own (:class:`~.config.RecipeOptions`,
:class:`~.config.RunOptions`); the recipe only changes defaults (:data:`TRAINER_DEFAULTS`, and what depends on the
machine or the size preset). Works unchanged under ``accelerate launch`` (DDP or FSDP): every rank trains on its own
packs (per-device token budget), per-step counts are gathered at the end, and only the main process prints and
writes the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import textwrap
from pathlib import Path

import torch

import cudnn_attention

from .compare import run_with_compare
from .config import (
    LEARNING_RATE,
    MAX_GRAD_NORM,
    WARMUP_SHARE,
    WEIGHT_DECAY,
    RecipeOptions,
    RunOptions,
    check_fp16,
    check_machine,
    check_strict,
)
from .data import STATS_KEY, PackedCollator, dataset_of
from .errors import RecipeError, flag, option_strings, usage_error
from .flops import step_flops_of
from .model import model_of
from .reporting import RunResult, announce_run, fallback_announced, finish, format_mfu, format_rate
from .run_dirs import checked_output_dir, new_run_dir, remove_empty_dirs
from .steps import StepRecorder
from .tokenizer import load_tokenizer

__all__ = ["TRAINER_DEFAULTS", "main", "parse", "run", "train_once"]

# The recipe's TrainingArguments defaults; any flag on the command line replaces them.
TRAINER_DEFAULTS = dict(
    per_device_train_batch_size=1,  # one pack of --tokens_per_step tokens is one row
    learning_rate=LEARNING_RATE,
    lr_scheduler_type="cosine",
    weight_decay=WEIGHT_DECAY,
    max_grad_norm=MAX_GRAD_NORM,
    save_strategy="no",
    report_to="none",
    remove_unused_columns=False,  # the collator's counts ride in the batch until training_step pops them
    seed=0,
    ddp_find_unused_parameters=False,  # every parameter gets a gradient every step; skip DDP's graph walk
)
# Filled in after parsing when not given: from the machine (use_cpu, bf16, dataloader_pin_memory), the size preset
# (max_steps) and the step count (warmup_steps, logging_steps); output_dir: a new folder per run.
_RESOLVED_LATER = ("use_cpu", "bf16", "dataloader_pin_memory", "max_steps", "warmup_steps", "logging_steps", "output_dir")
# TrainingArguments fields that transformers 5.24 renamed (the old names warn, FutureWarning: removed in v6): the recipe
# hands the value to the name this transformers has, so `--gradient_checkpointing` works quietly on 5.17 to 5.25 alike.
_RENAMED = (("gradient_checkpointing", "activation_checkpointing"), ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"))
# What `pip install` takes for the --report_to integrations whose package has another name.
_REPORTING_PACKAGES = {"azure_ml": "azureml-core", "comet_ml": "comet-ml", "flyte": "flytekit"}


def _fields(values: dict, dataclass_type) -> dict:
    return {f.name: values[f.name] for f in dataclasses.fields(dataclass_type) if f.init and f.name in values}


# What --help says of the flags it does not list: TrainingArguments' (about 130 of them, 600 lines of help).
_TRAINING_ARGUMENTS_HELP = (
    "Every transformers TrainingArguments flag is taken too (--learning_rate, --report_to, --gradient_checkpointing, "
    f"--save_strategy, ...), with the recipe's defaults: a cosine schedule at {LEARNING_RATE:g}, the size preset's steps, no "
    "checkpoints, bf16 on a GPU. --help-all lists them after these; so does"
)
_TRAINING_ARGUMENTS_DOCS = "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"


def _parser(family: str):
    """The recipe's argument parser: its own flags (:class:`RecipeOptions`, :class:`RunOptions`), then every
    ``TrainingArguments`` flag; ``--help`` lists the recipe's own and points to transformers' for the rest."""
    from transformers import HfArgumentParser, TrainingArguments

    own = {f.name for options in (RecipeOptions, RunOptions) for f in dataclasses.fields(options)} | {"help", argparse.SUPPRESS}

    class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """transformers' formatter (each flag's default shown), with the epilog as written: its link on a line of its own."""

    class RecipeArgumentParser(HfArgumentParser):
        full_help = False

        def error(self, message):  # one line: argparse's usage block lists every TrainingArguments field first
            usage_error(self.prog, message, options=option_strings(self), help_flag="--help-all")

        def format_help(self):
            if self.full_help:
                return super().format_help()
            hidden = [action for action in self._actions if action.dest not in own and action.help is not argparse.SUPPRESS]
            helps = [action.help for action in hidden]
            for action in hidden:
                action.help = argparse.SUPPRESS
            try:
                return super().format_help()
            finally:
                for action, text in zip(hidden, helps):
                    action.help = text

    class FullHelp(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

        def __call__(self, parser, namespace, values, option_string=None):
            parser.full_help = True
            parser.print_help()
            parser.exit()

    parser = RecipeArgumentParser(
        (RecipeOptions, RunOptions, TrainingArguments),
        usage="%(prog)s [the recipe's flags below] [any TrainingArguments flag]",
        epilog=f"{textwrap.fill(_TRAINING_ARGUMENTS_HELP, 100)}\n{_TRAINING_ARGUMENTS_DOCS}",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--help-all", action=FullHelp, help="show every flag, the TrainingArguments ones included, and exit")
    parser.set_defaults(family=family, **TRAINER_DEFAULTS, **dict.fromkeys(_RESOLVED_LATER))
    return parser


def parse(argv: list[str] | None = None, *, family: str = "mistral"):
    """``(options, run_options, training_args)`` from ``argv`` (default: the command line); ``family`` is the recipe's default
    model family. ``training_args.output_dir`` stays ``None`` unless given (:func:`run` makes a new folder)."""
    from transformers import TrainingArguments

    parser = _parser(family)
    values = vars(parser.parse_args(argv))
    _rename_for_this_transformers(values)
    if values["use_cpu"] is None:
        values["use_cpu"] = not torch.cuda.is_available()
    on_gpu = not values["use_cpu"] and torch.cuda.is_available()
    for name in ("bf16", "dataloader_pin_memory"):  # bf16 is what cuDNN serves; pinned memory only helps a GPU
        values[name] = on_gpu if values[name] is None else values[name]
    options = RecipeOptions(**_fields(values, RecipeOptions)).resolved(on_gpu=on_gpu)
    if values["max_steps"] in (None, -1):
        values["max_steps"] = options.budget().steps
    elif values["max_steps"] < 1:
        raise RecipeError(f"{flag('max_steps', values['max_steps'])}: pass 1 or more (default: the size preset's, -1 the same)")
    if values["warmup_steps"] is None:
        values["warmup_steps"] = int(values["max_steps"] * WARMUP_SHARE)
    if values["logging_steps"] is None:
        values["logging_steps"] = max(1, values["max_steps"] // 10)
    output_dir = values["output_dir"]
    args = TrainingArguments(**_fields(values, TrainingArguments))
    args.output_dir = output_dir  # TrainingArguments turns None into "trainer_output"; run() needs to know it was not given
    return options, RunOptions(**_fields(values, RunOptions)), args


def _rename_for_this_transformers(values: dict) -> None:
    """Move a value given under one name of a renamed ``TrainingArguments`` field (:data:`_RENAMED`) to the name this
    transformers has, so that it neither warns nor refuses it."""
    for old, new in _RENAMED:
        if new in values and values.get(old) is not None and values[new] is None:
            values[new], values[old] = values[old], None


def _check_reporting(report_to: list[str]) -> None:
    """Raise :class:`RecipeError` for a ``--report_to`` integration that is not installed (transformers would raise when the
    Trainer is built, after the model: a traceback that names no package)."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    given = flag("report_to", " ".join(report_to))
    unknown = [name for name in report_to if name not in ("all", "none") and name not in INTEGRATION_TO_CALLBACK]
    if unknown:
        known = ", ".join(INTEGRATION_TO_CALLBACK)
        raise RecipeError(f"{given}: transformers knows no integration {', '.join(map(repr, unknown))}; pass one of {known}, all or none")
    missing = [name for name in report_to if name in INTEGRATION_TO_CALLBACK and name not in get_available_reporting_integrations()]
    if missing:
        packages = " ".join(_REPORTING_PACKAGES.get(name, name) for name in missing)
        raise RecipeError(f"{given} needs {', '.join(missing)}, which is not installed here: pip install {packages}")


def _trainer_classes():
    """``Trainer`` subclass and callbacks, defined on first use so that importing this module does not import transformers' trainer."""
    from transformers import ProgressCallback, Trainer, TrainerCallback

    class RecordSteps(TrainerCallback):
        """Starts and ends each optimizer step on the :class:`StepRecorder` (every rank)."""

        def __init__(self, recorder: StepRecorder):
            self.recorder = recorder

        def on_step_begin(self, args, state, control, **kwargs):
            self.recorder.begin()

        def on_step_end(self, args, state, control, **kwargs):
            self.recorder.end_step()

    class TokensProgress(ProgressCallback):
        """transformers' progress bar with the step's loss, tokens/s and MFU beside the step count (what the summary reports)."""

        def __init__(self, recorder: StepRecorder):
            super().__init__()
            self.recorder = recorder

        def on_step_end(self, args, state, control, **kwargs):
            super().on_step_end(args, state, control, **kwargs)
            if self.training_bar is not None and self.recorder.losses:
                live = self.recorder.live()
                mfu = f", MFU {format_mfu(live['mfu'])}" if live["mfu"] is not None else ""
                loss = self.recorder.losses[-1].item()  # the recorder's clock synchronized already: no extra wait
                self.training_bar.set_postfix_str(f"loss {loss:.4f}, {format_rate(live['tokens_per_s'])} tokens/s{mfu}")

    class PackedTrainer(Trainer):
        """Pops the collator's per-step counts before the model call and hands them, with the loss, to the recorder."""

        def __init__(self, *args, recorder: StepRecorder, **kwargs):
            super().__init__(*args, callbacks=[RecordSteps(recorder)], **kwargs)
            self.recorder = recorder
            if self.pop_callback(ProgressCallback) is not None:  # a terminal (not a notebook, not --disable_tqdm)
                self.add_callback(TokensProgress(recorder))

        def training_step(self, model, inputs, num_items_in_batch=None):
            counts = inputs.pop(STATS_KEY)
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.recorder.add_batch(counts, loss)
            return loss

        def log(self, logs, start_time=None):
            if "loss" in logs:  # the logged lines (and TensorBoard, W&B, ...) carry the bar's figures
                live = self.recorder.live()
                logs["tokens_per_s"] = round(live["tokens_per_s"]) if live["tokens_per_s"] else None
                if live["mfu"] is not None:
                    logs["mfu"] = round(live["mfu"], 4)
            super().log(logs, start_time)

    return PackedTrainer


def train_once(options: RecipeOptions, args, implementation: str, *, dataset, tokenizer) -> RunResult:
    """Train ``args.max_steps`` steps with ``implementation`` from the seed's initial weights; return what was measured."""
    PackedTrainer = _trainer_classes()
    cuda = args.device.type == "cuda"
    # bf16 weights on a GPU (what cuDNN serves); the CPU fallback computes in fp32
    dtype = torch.bfloat16 if cuda else torch.float32
    model = model_of(options, implementation=implementation, tokenizer=tokenizer, device=args.device, dtype=dtype, seed=args.seed)
    # step_flops_of before any wrapping (FSDP shards the parameters)
    recorder = StepRecorder(step_flops=step_flops_of(model), device=args.device, planned_steps=args.max_steps, world_size=args.world_size)
    trainer = PackedTrainer(model=model, args=args, train_dataset=dataset, data_collator=PackedCollator(), recorder=recorder)
    with cudnn_attention.strict() if options.strict else contextlib.nullcontext():
        trainer.train()
    return recorder.result(
        attn_implementation=implementation, gather=lambda t: trainer.accelerator.gather(t[None]), distributed=_distributed(trainer)
    )


def _distributed(trainer) -> str:
    kind = trainer.accelerator.distributed_type.value  # "NO", "MULTI_GPU", "FSDP", ...
    return {"NO": "single process", "MULTI_GPU": "DDP", "MULTI_CPU": "DDP"}.get(kind, kind) + (
        f" v{trainer.accelerator.state.fsdp_plugin.fsdp_version}" if kind == "FSDP" else ""
    )


def _run_dir(args, run_options: RunOptions, *, recipe: str, main_process: bool) -> tuple[Path, Path]:
    """The run's folder and the folder that stays if the run leaves nothing there (see ``remove_empty_dirs``)."""
    if args.output_dir is not None:
        return checked_output_dir(args.output_dir, overwrite=run_options.overwrite_output_dir)
    from accelerate.utils import broadcast_object_list

    # The main process names and creates the folder; every rank needs the same one (FSDP saves a shard from each).
    chosen = [str(new_run_dir(recipe)) if main_process else None]
    return Path(broadcast_object_list(chosen)[0]), Path.cwd()


def run(options: RecipeOptions, run_options: RunOptions, args, *, recipe: str) -> dict:
    """Train (and compare), then on the main process print the summary and write ``metrics.json`` and ``loss.png``; returns the
    metrics. Each implementation's ``Trainer`` writes (checkpoints, TensorBoard logs) into ``<run folder>/<implementation>``."""
    from accelerate import PartialState

    device = args.device  # sets up the process group under accelerate launch / torchrun
    main_process = PartialState().is_main_process
    check_machine(size=options.size, tokens_per_step=options.tokens_per_step, device=device)
    check_strict(strict=options.strict, device=device)
    check_fp16(fp16=args.fp16, device=device)
    _check_reporting(args.report_to)
    if args.output_dir is not None:  # a folder that cannot take the results is refused before the data is read (_run_dir again below)
        checked_output_dir(args.output_dir, overwrite=run_options.overwrite_output_dir)
    tokenizer = load_tokenizer(tokenizer=options.tokenizer, checkpoint=options.checkpoint)
    dataset = dataset_of(options, tokenizer=tokenizer, seed=args.seed)
    if main_process:
        announce_run(
            recipe=recipe,
            options=options,
            implementation=options.attn_implementation,
            device=device,
            steps=args.max_steps,
            packs=dataset.packs,
            packs_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps,  # one pack per row
            world_size=args.world_size,
        )
    output_dir, keep = _run_dir(args, run_options, recipe=recipe, main_process=main_process)

    def run_once(implementation: str) -> RunResult:
        implementation_args = dataclasses.replace(args, output_dir=str(output_dir / implementation))
        with fallback_announced(device=str(device)):
            return train_once(options, implementation_args, implementation, dataset=dataset, tokenizer=tokenizer)

    try:
        results = run_with_compare(run_once, primary=options.attn_implementation, references=run_options.compare, device=str(device))
        config = {
            **dataclasses.asdict(options),
            **dataclasses.asdict(run_options),
            "steps": args.max_steps,
            "output_dir": str(output_dir),
            "training_arguments": args.to_dict(),
        }
        return finish(
            recipe=recipe,
            results=results,
            primary=options.attn_implementation,
            config=config,
            output_dir=output_dir,
            title=f"{recipe}: {options.model_name()}",
            write=main_process,
        )
    finally:
        if main_process:
            remove_empty_dirs(output_dir, keep=keep)  # the Trainers' folders when nothing was saved; the run's own when it failed


def main(argv: list[str] | None = None, *, recipe: str, family: str) -> dict:
    """Programmatic entry of a Trainer recipe (``argv``: its command-line flags); ``family`` is the recipe's default model."""
    options, run_options, args = parse(argv, family=family)
    if run_options.context_parallel != 1:  # 1: the Trainer as before; else the context-parallel loop (which refuses < 1)
        from .context_parallel import run_context_parallel

        return run_context_parallel(options, run_options, args, recipe=recipe)
    return run(options, run_options, args, recipe=recipe)
