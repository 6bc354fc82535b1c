"""What a recipe run is: :class:`RecipeConfig` (the command line) and the size presets it resolves to.

Presets pair a model shape with a data budget. ``tiny`` runs anywhere in seconds (CPU, CI); ``small``
matches the configurations of ``shared/notes/gpu-baseline.md`` (so figures compare with today's
sdpa/flex_attention numbers); ``1b-like`` is a Llama-3.2-1B-sized body; ``long`` packs documents of
16k-32k tokens, where attention dominates the step.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["FAMILIES", "IMPLEMENTATIONS", "SIZES", "DataBudget", "ModelShape", "RecipeConfig", "data_budget", "model_shape", "parse_config"]

FAMILIES = ("mistral", "gpt_oss", "llama")
SIZES = ("tiny", "small", "1b-like", "long")
IMPLEMENTATIONS = ("cudnn", "eager", "sdpa", "flex_attention")


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
# gpu-baseline.md's rows: Llama/Mistral-like 8 x 2048 (16/4 heads, D 128, window 1024) and
# gpt-oss-like 4 x 1024 (16/4 heads, D 64, window 128 alternating with full layers, 4 experts).
_SMALL = ModelShape(hidden=2048, layers=8, heads=16, kv_heads=4, head_dim=128, intermediate=5632)
_SMALL_SINKS = ModelShape(hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, intermediate=1024, experts=4, experts_per_token=2)
_1B = ModelShape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192)
_1B_SINKS = ModelShape(hidden=2048, layers=12, heads=32, kv_heads=8, head_dim=64, intermediate=1024, experts=8, experts_per_token=2)
# gpu-baseline.md's long-context row: 4 x 2048, 16/4 heads, D 128.
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
    # gpu-baseline.md: 16384 real tokens per step in documents of 256-4096 tokens.
    "small": DataBudget(tokens_per_step=16384, steps=200, min_doc_tokens=256, max_doc_tokens=4096),
    "1b-like": DataBudget(tokens_per_step=16384, steps=200, min_doc_tokens=256, max_doc_tokens=4096),
    # gpu-baseline.md's long-context step had 49,152 tokens, longest document 16,384; here 2-4 documents of
    # 16k-32k tokens per step: attention is about half of the model FLOPs (more of the time: its kernels run
    # below the matmuls' rate).
    "long": DataBudget(tokens_per_step=65536, steps=50, min_doc_tokens=16384, max_doc_tokens=32768),
}


def model_shape(*, family: str, size: str) -> ModelShape:
    """The shape of ``family`` at ``size``; the family decides the window and the experts."""
    if family not in FAMILIES or size not in _SHAPES:
        raise ValueError(f"unknown family/size {family!r}/{size!r}; families {FAMILIES}, sizes {SIZES}")
    dense, sinks, mistral_window, gpt_oss_window = _SHAPES[size]
    if family == "gpt_oss":
        return dataclasses.replace(sinks, window=gpt_oss_window)
    return dataclasses.replace(dense, window=mistral_window if family == "mistral" else None)


def data_budget(
    *, size: str, tokens_per_step: int | None = None, steps: int | None = None, min_doc_tokens: int | None = None,
    max_doc_tokens: int | None = None,
) -> DataBudget:  # fmt: skip
    """The data budget of ``size``, with the given fields in place of the preset's (``None``: the preset's); a document
    is never longer than a step's tokens."""
    if size not in _BUDGETS:
        raise ValueError(f"unknown size {size!r}; sizes {SIZES}")
    preset = _BUDGETS[size]
    tokens_per_step = tokens_per_step or preset.tokens_per_step
    return DataBudget(tokens_per_step=tokens_per_step, steps=steps or preset.steps, min_doc_tokens=min_doc_tokens or preset.min_doc_tokens,
                      max_doc_tokens=min(max_doc_tokens or preset.max_doc_tokens, tokens_per_step))  # fmt: skip


@dataclass(kw_only=True)
class RecipeConfig:
    """Everything a Trainer recipe run takes; each field is a command-line flag (``--tokens_per_step`` or ``--tokens-per-step``).

    ``None`` fields are filled by :meth:`resolved` from the device and the size preset.
    """

    model: Literal["mistral", "gpt_oss", "llama"] = field(
        default="mistral", metadata={"help": "model family: mistral (sliding window), gpt_oss (sinks + alternating window), llama"}
    )
    size: Literal["auto", "tiny", "small", "1b-like", "long"] = field(
        default="auto", metadata={"help": "size preset; auto = small on a GPU, tiny on a CPU"}
    )
    tokens_per_step: int | None = field(default=None, metadata={"help": "real tokens per optimizer step and device; None: the preset's"})
    steps: int | None = field(default=None, metadata={"help": "optimizer steps; None: the size preset's"})
    lr: float = field(default=5e-4, metadata={"help": "peak learning rate (cosine schedule, 10%% warmup)"})
    attn: Literal["cudnn", "eager", "sdpa", "flex_attention"] = field(default="cudnn", metadata={"help": "attn_implementation"})
    compare: list[str] = field(
        default_factory=list,
        metadata={"help": "also run the same steps with these implementations (eager sdpa flex_attention) and compare loss, speed "
                          "and memory", "choices": IMPLEMENTATIONS[1:]},
    )  # fmt: skip
    strict: bool = field(default=False, metadata={"help": "raise instead of falling back from cuDNN (cudnn_attention.strict)"})
    output_dir: str | None = field(default=None, metadata={"help": "where metrics.json and loss.png go; None: runs/<recipe>"})
    checkpoint: str | None = field(default=None, metadata={"help": "local Hugging Face checkpoint directory to fine-tune"})
    tokenizer: str | None = field(default=None, metadata={"help": "local tokenizer directory; None: the checkpoint's, else bytes"})
    dataset: str | None = field(default=None, metadata={"help": "local .txt or .jsonl file; None: Python's own pydoc_data.topics text"})
    text_field: str = field(default="text", metadata={"help": "the .jsonl field holding each document's text"})
    min_doc_tokens: int | None = field(default=None, metadata={"help": "shortest document cut from running text; None: the preset's"})
    max_doc_tokens: int | None = field(default=None, metadata={"help": "longest document; None: the size preset's"})
    seed: int = field(default=0, metadata={"help": "seed of the model init and the batch order (the same in compare runs)"})
    device: str | None = field(default=None, metadata={"help": "cuda or cpu; None: cuda when available"})

    def resolved(self) -> RecipeConfig:
        """A copy with every ``None`` default filled in (device, size, budget)."""
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and "LOCAL_RANK" in os.environ:
            # accelerate launch / torchrun: each process builds its model on its own GPU, not all on GPU 0.
            device = f"cuda:{os.environ['LOCAL_RANK']}"
        size = self.size if self.size != "auto" else ("small" if device.startswith("cuda") else "tiny")
        budget = data_budget(size=size, tokens_per_step=self.tokens_per_step, steps=self.steps, min_doc_tokens=self.min_doc_tokens,
                             max_doc_tokens=self.max_doc_tokens)  # fmt: skip
        return dataclasses.replace(self, device=device, size=size, **dataclasses.asdict(budget))

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on a GPU (what cuDNN serves); fp32 on a CPU (the fallback computes in fp32 anyway)."""
        return torch.bfloat16 if str(self.device).startswith("cuda") else torch.float32


def parse_config(argv: list[str] | None = None, **defaults) -> RecipeConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a :class:`RecipeConfig`; ``defaults`` replace field defaults (a recipe's family)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(RecipeConfig)
    if defaults:
        parser.set_defaults(**defaults)
    (config,) = parser.parse_args_into_dataclasses(args=argv)
    return config
