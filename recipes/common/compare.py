"""Compare mode: the same steps (same seed, weights and batches) with another ``attn_implementation``.

An implementation that cannot run here is recorded as skipped with the reason, never silently
dropped; :func:`reporting.comparison` turns two results into the loss-curve difference, the
speedup and the peak memory of each.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from .model import UnsupportedImplementation
from .reporting import RunResult

__all__ = ["run_with_compare", "skip_reason"]


def skip_reason(implementation: str, *, device: str) -> str | None:
    """Why ``implementation`` cannot train on ``device``, decided before building anything; else ``None``."""
    if implementation == "flex_attention" and not str(device).startswith("cuda"):
        # torch raises "FlexAttention does not support backward on CPU" (after ~30 s of compiling).
        return "flex_attention has no backward on CPU in torch; run the flex_attention comparison on a GPU"
    return None


def run_with_compare(run_once: Callable[[str], RunResult], *, primary: str, reference: str | None, device: str) -> dict[str, RunResult]:
    """``{primary: result, reference: result}``; ``run_once(implementation)`` trains once and returns its result."""
    results = {primary: run_once(primary)}
    if reference is None or reference == primary:
        return results
    reason = skip_reason(reference, device=device)
    if reason is None:
        try:
            results[reference] = run_once(reference)
        except UnsupportedImplementation as error:
            reason = str(error)
        except torch.OutOfMemoryError as error:
            # eager materializes every document's full score matrix: expected at long contexts.
            reason = f"out of memory ({str(error).splitlines()[0]})"
    if reason is not None:
        print(f"compare: {reference} skipped: {reason}")
        results[reference] = RunResult(attn_implementation=reference, skipped=reason)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results
