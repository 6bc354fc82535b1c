"""Shared pieces of the training recipes: options and presets, offline data and tokenizer, model builder, FLOPs, the step
recorder, reporting, run folders, compare mode and one-line user errors.

Imported as ``cudnn_attention.recipes.common`` (the recipes, their tests and the benchmarks alike).
"""

from .compare import run_with_compare, skip_reason
from .config import (
    FAMILIES,
    IMPLEMENTATIONS,
    REFERENCES,
    SIZES,
    DataBudget,
    ModelShape,
    RecipeOptions,
    RunOptions,
    check_machine,
    data_budget,
    help_of,
    model_shape,
)
from .data import (
    STATS_KEY,
    PackedCollator,
    PackedDataset,
    RecipeDataWarning,
    build_dataset,
    cut_documents,
    load_texts,
    pack_documents,
    warn_if_repeated,
)
from .errors import RecipeError, run_command
from .flops import StepFlops, causal_pairs, step_flops_of
from .model import UnsupportedImplementation, build_model
from .reporting import (
    IMPLEMENTATION_COLORS,
    RunResult,
    comparison,
    draw_losses,
    finish,
    header,
    plot_losses,
    served_by,
    step_columns,
    step_row,
    write_metrics,
)
from .run_dirs import checked_output_dir, new_run_dir, remove_empty_dirs
from .steps import StepRecorder
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "FAMILIES",
    "IMPLEMENTATIONS",
    "IMPLEMENTATION_COLORS",
    "REFERENCES",
    "SIZES",
    "STATS_KEY",
    "ByteTokenizer",
    "DataBudget",
    "HFTokenizer",
    "ModelShape",
    "PackedCollator",
    "PackedDataset",
    "RecipeDataWarning",
    "RecipeError",
    "RecipeOptions",
    "RunOptions",
    "RunResult",
    "StepFlops",
    "StepRecorder",
    "UnsupportedImplementation",
    "build_dataset",
    "build_model",
    "causal_pairs",
    "check_machine",
    "checked_output_dir",
    "comparison",
    "cut_documents",
    "data_budget",
    "draw_losses",
    "finish",
    "header",
    "help_of",
    "load_texts",
    "load_tokenizer",
    "model_shape",
    "new_run_dir",
    "pack_documents",
    "plot_losses",
    "remove_empty_dirs",
    "run_command",
    "run_with_compare",
    "served_by",
    "skip_reason",
    "step_columns",
    "step_flops_of",
    "step_row",
    "warn_if_repeated",
    "write_metrics",
]
