"""What a recipe run is: the knobs both engines take (:class:`RecipeOptions`, :class:`RunOptions`), the size presets
they resolve to, and the optimizer settings every recipe shares.

Each knob is written once, here: the Trainer recipes parse these dataclasses with ``HfArgumentParser``
(``--size``, ``--compare``, ...) next to ``TrainingArguments``, which reads each field's ``help``; the Lightning recipe's
module passes its keyword arguments to a subclass of :class:`RecipeOptions`, and LightningCLI makes them its
``--model.*`` flags with the help of the ``Args:`` section :func:`document_fields` writes from the same ``help``.

Presets pair a model shape with a data budget. ``tiny`` runs anywhere in seconds (CPU, CI); ``small`` is the
configuration of the first end-to-end measurements (an H200, torch 2.11, transformers 5.17, 16,384 real tokens
per step in documents of 256-4,096 tokens: sdpa 52k tokens/s at 23.6 GiB, flex_attention 125k at 18.8 GiB for
the Llama-like body), so later figures compare with those; ``1b-like`` is a Llama-3.2-1B-sized body; ``long``
packs documents of 16k-32k tokens, where attention dominates the step.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Literal, get_args

from .errors import RecipeError, flag

__all__ = [
    "FAMILIES",
    "IMPLEMENTATIONS",
    "LEARNING_RATE",
    "MAX_GRAD_NORM",
    "REFERENCES",
    "SIZES",
    "WARMUP_SHARE",
    "WEIGHT_DECAY",
    "DataBudget",
    "Family",
    "Implementation",
    "ModelShape",
    "RecipeOptions",
    "Reference",
    "RunOptions",
    "Size",
    "check_fp16",
    "check_machine",
    "check_strict",
    "data_budget",
    "document_fields",
    "help_of",
    "model_shape",
]

Family = Literal["mistral", "gpt_oss", "llama"]
Preset = Literal["tiny", "small", "1b-like", "long"]
Size = Literal["auto", Preset]
# What compare mode runs next to the primary implementation.
Reference = Literal["eager", "sdpa", "flex_attention", "flash_attention_4"]
Implementation = Literal["cudnn", Reference]
FAMILIES, SIZES, REFERENCES, IMPLEMENTATIONS = get_args(Family), get_args(Preset), get_args(Reference), get_args(Implementation)

# The optimizer of every recipe: AdamW, cosine schedule after a linear warmup over the first tenth of the steps,
# gradients clipped to norm 1.
LEARNING_RATE = 5e-4
WEIGHT_DECAY = 0.1
WARMUP_SHARE = 0.1
MAX_GRAD_NORM = 1.0


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder body: attention heads/dims, MLP width, sliding window (None: full attention), experts (gpt-oss)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    window: int | None = None
    experts: int = 0
    experts_per_token: int = 0


@dataclass(frozen=True, kw_only=True)
class DataBudget:
    """Tokens packed into one optimizer step (per device), default steps, and the document-length range."""

    tokens_per_step: int
    steps: int
    min_doc_tokens: int
    max_doc_tokens: int


_TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128)
# The first end-to-end measurements' models: Llama/Mistral-like 8 x 2048 (16/4 heads, D 128, window 1024) and
# gpt-oss-like 4 x 1024 (16/4 heads, D 64, window 128 alternating with full layers, 4 experts).
_SMALL = ModelShape(hidden=2048, layers=8, heads=16, kv_heads=4, head_dim=128, intermediate=5632)
_SMALL_SINKS = ModelShape(hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, intermediate=1024, experts=4, experts_per_token=2)
_1B = ModelShape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192)
_1B_SINKS = ModelShape(hidden=2048, layers=12, heads=32, kv_heads=8, head_dim=64, intermediate=1024, experts=8, experts_per_token=2)
# The first long-context measurement's body: 4 x 2048, 16/4 heads, D 128.
_LONG = ModelShape(hidden=2048, layers=4, heads=16, kv_heads=4, head_dim=128, intermediate=5632)

# size -> (shape for mistral/llama, shape for gpt_oss, mistral window, gpt_oss window)
_SHAPES = {
    "tiny": (_TINY, dataclasses.replace(_TINY, experts=4, experts_per_token=2), 64, 32),
    "small": (_SMALL, _SMALL_SINKS, 1024, 128),
    "1b-like": (_1B, _1B_SINKS, 4096, 128),
    # A window of 16k still slides inside the 32k documents, yet leaves attention most of the work.
    "long": (_LONG, _SMALL_SINKS, 16384, 128),
}

_BUDGETS = {
    # 1024 tokens/step keeps the CPU fallback (exact fp32 math) at a fraction of a second per step.
    "tiny": DataBudget(tokens_per_step=1024, steps=5, min_doc_tokens=16, max_doc_tokens=512),
    "small": DataBudget(tokens_per_step=16384, steps=200, min_doc_tokens=256, max_doc_tokens=4096),
    "1b-like": DataBudget(tokens_per_step=16384, steps=200, min_doc_tokens=256, max_doc_tokens=4096),
    # 2-4 documents of 16k-32k tokens per step: attention is about half of the model FLOPs (more of the time: its
    # kernels run below the matmuls' rate). The first long-context measurement packed 49,152 tokens, longest 16,384.
    "long": DataBudget(tokens_per_step=65536, steps=50, min_doc_tokens=16384, max_doc_tokens=32768),
}

# GPU memory the preset's own token budget needs: benchmarks/results/recipes_speed.md measured a peak of 25.6 GiB
# for the Mistral-like long run on cuDNN (H200, bf16); allocator slack and the CUDA context come on top.
_GPU_GIB_NEEDED = {"long": 32}


def model_shape(*, family: str, size: str) -> ModelShape:
    """The shape of ``family`` at ``size``; the family decides the window and the experts."""
    if family not in FAMILIES or size not in _SHAPES:
        raise ValueError(f"unknown family/size {family!r}/{size!r}; families {FAMILIES}, sizes {SIZES}")
    dense, sinks, mistral_window, gpt_oss_window = _SHAPES[size]
    if family == "gpt_oss":
        return dataclasses.replace(sinks, window=gpt_oss_window)
    return dataclasses.replace(dense, window=mistral_window if family == "mistral" else None)


def data_budget(
    *,
    size: str,
    tokens_per_step: int | None = None,
    steps: int | None = None,
    min_doc_tokens: int | None = None,
    max_doc_tokens: int | None = None,
) -> DataBudget:
    """The data budget of ``size``, with the given fields in place of the preset's (``None``: the preset's); a document
    is never longer than a step's tokens, nor the preset's shortest document longer than the longest.

    Raises :class:`RecipeError`, naming the flag, for a value no run can train on: a step or a longest document of
    fewer than 2 tokens (a document's first token has no label, so nothing would be predicted and the loss would be
    NaN), fewer than 1 step, or a given shortest document longer than the longest.
    """
    if size not in _BUDGETS:
        raise ValueError(f"unknown size {size!r}; sizes {SIZES}")
    preset = _BUDGETS[size]
    for name, value, least, why in (
        ("tokens_per_step", tokens_per_step, 2, "a document's first token has no label, so a step needs 2 tokens to predict one"),
        ("max_doc_tokens", max_doc_tokens, 2, "a document's first token has no label, so a document needs 2 tokens to predict one"),
        ("min_doc_tokens", min_doc_tokens, 1, "a document holds at least one token"),
        ("max_steps", steps, 1, "a run trains at least one optimizer step"),
    ):
        if value is not None and value < least:
            raise RecipeError(f"{flag(name, value)}: pass {least} or more ({why})")
    tokens = preset.tokens_per_step if tokens_per_step is None else tokens_per_step
    longest = min(preset.max_doc_tokens if max_doc_tokens is None else max_doc_tokens, tokens)
    if min_doc_tokens is None:
        shortest = min(preset.min_doc_tokens, longest)
    elif min_doc_tokens > longest:
        if max_doc_tokens is not None and max_doc_tokens <= tokens:
            source = f"{flag('max_doc_tokens', max_doc_tokens)}"
        elif tokens_per_step is not None and tokens < (max_doc_tokens or preset.max_doc_tokens):
            source = f"{flag('tokens_per_step', tokens)}: no document is longer than a step"
        else:
            source = f"the {size} preset's; {flag('max_doc_tokens')} sets it"
        raise RecipeError(
            f"{flag('min_doc_tokens', min_doc_tokens)} is longer than the longest document, {longest} tokens ({source}): "
            f"pass a {flag('min_doc_tokens')} of at most {longest}"
        )
    else:
        shortest = min_doc_tokens
    steps = preset.steps if steps is None else steps
    return DataBudget(tokens_per_step=tokens, steps=steps, min_doc_tokens=shortest, max_doc_tokens=longest)


def check_machine(*, size: str, tokens_per_step: int, device, gpu_name: str | None = None, gpu_gib: float | None = None) -> None:
    """Raise :class:`RecipeError` when ``size`` cannot train on this machine (``device``, and the GPU's total memory,
    read from ``device`` unless ``gpu_name``/``gpu_gib`` are given).

    A smaller ``tokens_per_step`` than the preset's lowers what it needs in proportion (activations dominate).
    """
    needed = _GPU_GIB_NEEDED.get(size)
    if needed is None:
        return
    needed *= tokens_per_step / _BUDGETS[size].tokens_per_step
    if not str(device).startswith("cuda"):
        raise RecipeError(
            f"{flag('size', size)} needs a GPU with about {needed:.0f} GiB (device here: {device}); on a CPU use {flag('size', 'tiny')}"
        )
    if gpu_gib is None:
        import torch

        properties = torch.cuda.get_device_properties(device)
        gpu_name, gpu_gib = properties.name, properties.total_memory / 2**30
    if gpu_gib < needed:
        raise RecipeError(
            f"{flag('size', size)} at {tokens_per_step:,} tokens per step needs about {needed:.0f} GiB of GPU memory and {gpu_name} has "
            f"{gpu_gib:.0f} GiB: pass {flag('tokens_per_step', int(tokens_per_step * gpu_gib / needed) // 1024 * 1024)} or "
            f"{flag('size', 'small')}"
        )


def check_strict(*, strict: bool, device) -> None:
    """Raise :class:`RecipeError` when strict mode is asked for where cuDNN can serve no call: without a GPU, or without
    the cuDNN frontend (before any step, rather than as the first attention call's error)."""
    if not strict:
        return
    if not str(device).startswith("cuda"):
        raise RecipeError(
            f"{flag('strict')} turns every call cuDNN cannot serve into an error, and without a GPU (device here: {device}) it serves "
            f"none: leave out {flag('strict')} to train on the exact fallback, or run on a GPU"
        )
    from cudnn_attention.frontend import frontend_unavailable_reason

    reason = frontend_unavailable_reason()
    if reason is not None:
        raise RecipeError(f"{flag('strict')} needs cuDNN, and here the {reason}: install it, or leave out {flag('strict')}")


def check_fp16(*, fp16: bool, device) -> None:
    """Raise :class:`RecipeError` for ``--fp16`` without a GPU: accelerate turns fp16 mixed precision off on a CPU (no
    autocast to float16 there), so the run would train in float32 while its arguments, and ``metrics.json``, say fp16.
    ``--bf16`` autocasts on a CPU too, and stays allowed."""
    if fp16 and not str(device).startswith("cuda"):
        raise RecipeError(
            f"{flag('fp16')} needs a GPU: on a CPU (device here: {device}) accelerate turns fp16 mixed precision off, and the run "
            f"trains in float32 while metrics.json says fp16: leave out {flag('fp16')}, or pass {flag('bf16')} for bfloat16 autocast "
            "on the CPU"
        )


def help_of(options: type, name: str) -> str:
    """The help text of field ``name`` of an options dataclass (what ``--help`` shows for it)."""
    return {f.name: f for f in dataclasses.fields(options)}[name].metadata["help"]


def document_fields(options: type) -> type:
    """Class decorator: append an ``Args:`` section with each field's ``help`` to the dataclass's docstring (what
    ``help()`` shows, and where LightningCLI finds each flag's description)."""
    lines = "".join(f"    {f.name}: {f.metadata['help']}\n" for f in dataclasses.fields(options))
    options.__doc__ = f"{inspect.cleandoc(options.__doc__ or options.__name__)}\n\nArgs:\n{lines}"
    return options


@document_fields
@dataclass(kw_only=True)
class RecipeOptions:
    """The model and data of a recipe run (the Lightning recipe's ``--model.*`` flags). ``None``: the size preset's."""

    family: Family = field(
        default="mistral",
        metadata={"help": "model family: mistral (sliding window), gpt_oss (sinks + alternating window), llama", "aliases": ["--model"]},
    )
    size: Size = field(default="auto", metadata={"help": "size preset; auto = small on a GPU, tiny on a CPU"})
    attn_implementation: Implementation = field(
        default="cudnn", metadata={"help": "attention of the primary run (cudnn, or a transformers implementation)", "aliases": ["--attn"]}
    )
    strict: bool = field(default=False, metadata={"help": "raise instead of falling back from cuDNN (cudnn_attention.strict)"})
    tokens_per_step: int | None = field(default=None, metadata={"help": "real tokens per optimizer step and device; None: the preset's"})
    min_doc_tokens: int | None = field(default=None, metadata={"help": "shortest document cut from running text; None: the preset's"})
    max_doc_tokens: int | None = field(default=None, metadata={"help": "longest document (longer records are split); None: the preset's"})
    checkpoint: str | None = field(
        default=None, metadata={"help": "local Hugging Face checkpoint directory to fine-tune; None: random init"}
    )
    tokenizer: str | None = field(default=None, metadata={"help": "local tokenizer directory; None: the checkpoint's, else UTF-8 bytes"})
    dataset: str | None = field(default=None, metadata={"help": "local .txt or .jsonl file; None: Python's own pydoc_data.topics text"})
    text_field: str = field(default="text", metadata={"help": "the .jsonl field holding each document's text"})

    def resolved(self, *, on_gpu: bool) -> RecipeOptions:
        """A copy with the size (``auto``: small on a GPU, tiny on a CPU) and every ``None`` budget field filled in."""
        size = self.size if self.size != "auto" else ("small" if on_gpu else "tiny")
        budget = self.budget(size=size)
        return dataclasses.replace(
            self,
            size=size,
            tokens_per_step=budget.tokens_per_step,
            min_doc_tokens=budget.min_doc_tokens,
            max_doc_tokens=budget.max_doc_tokens,
        )

    def budget(self, *, size: str | None = None) -> DataBudget:
        """The data budget of ``size`` (default: this size, resolved) with these options' fields in place of the preset's."""
        return data_budget(
            size=size or self.size,
            tokens_per_step=self.tokens_per_step,
            min_doc_tokens=self.min_doc_tokens,
            max_doc_tokens=self.max_doc_tokens,
        )

    def model_name(self) -> str:
        """How the header and plot title name the model: the checkpoint, or the family and size of a random init."""
        return self.checkpoint or f"random-init {self.family} ({self.size})"


@document_fields
@dataclass(kw_only=True)
class RunOptions:
    """What a run does around the training (flags of every recipe)."""

    compare: list[str] = field(
        default_factory=list,
        metadata={
            "help": "also run the same steps with these implementations and compare loss, speed and memory "
            "(flash_attention_4 where installed)",
            "choices": REFERENCES,
        },
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "write into an output directory that already holds a run's metrics.json"}
    )
    context_parallel: int = field(
        default=1,
        metadata={
            "help": "split each pack's tokens across N ranks (context parallelism, the recipe's own loop): a CPU starts N gloo "
            "processes; GPUs need N processes per pack from torchrun/accelerate launch"
        },
    )
