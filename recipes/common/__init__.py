"""Shared pieces of the training recipes: config, offline data and tokenizer, model builder, FLOPs, reporting, compare mode.

The recipes (``recipes/train_*.py``) put this folder on ``sys.path`` (Python does so for a script's
own folder) and import ``common``; tests do the same.
"""

from .compare import run_with_compare, skip_reason
from .config import RecipeConfig, data_budget, model_shape, parse_config
from .data import STATS_KEY, PackedCollator, PackedDataset, build_dataset, cut_documents, load_texts, pack_documents
from .flops import StepFlops, causal_pairs, step_flops_of
from .model import UnsupportedImplementation, build_model
from .reporting import RunResult, comparison, finish, plot_losses, served_by, step_columns, step_row, write_metrics
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "STATS_KEY",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedCollator",
    "PackedDataset",
    "RecipeConfig",
    "RunResult",
    "StepFlops",
    "UnsupportedImplementation",
    "build_dataset",
    "build_model",
    "causal_pairs",
    "comparison",
    "cut_documents",
    "data_budget",
    "finish",
    "load_texts",
    "load_tokenizer",
    "model_shape",
    "pack_documents",
    "parse_config",
    "plot_losses",
    "run_with_compare",
    "served_by",
    "skip_reason",
    "step_columns",
    "step_flops_of",
    "step_row",
    "write_metrics",
]
