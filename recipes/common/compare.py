"""Compare mode: the same steps (same seed, weights and batches) with other ``attn_implementation`` values.

An implementation that cannot run here is recorded as skipped with the reason, never silently
dropped; :func:`reporting.comparison` turns two results into the loss-curve difference, the
speedup and the peak memory of each. Every run starts from zeroed ``cudnn_attention`` counters and
peak-memory statistics, and what it allocated is freed before the next.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch

import cudnn_attention

from .model import UnsupportedImplementation
from .reporting import RunResult

__all__ = ["run_with_compare", "skip_reason"]


# FlashAttention 4's CuTe kernels (PyPI flash-attn-4), learnable-sink backward included, are built for these
# compute capabilities (Hopper, Blackwell).
_FA4_CAPABILITIES = (9, 10, 11)


def skip_reason(implementation: str, *, device: str) -> str | None:
    """Why ``implementation`` cannot train on ``device``, decided before building anything; else ``None``."""
    on_gpu = str(device).startswith("cuda")
    if implementation == "flex_attention" and not on_gpu:
        # torch raises "FlexAttention does not support backward on CPU" (after ~30 s of compiling).
        return "flex_attention has no backward on CPU in torch; run the flex_attention comparison on a GPU"
    if implementation == "flash_attention_4":
        return _flash_attention_4_missing(device=device, on_gpu=on_gpu)
    return None


def _flash_attention_4_missing(*, device: str, on_gpu: bool) -> str | None:
    if not on_gpu:
        return "flash_attention_4 runs FlashAttention's CuTe kernels on sm90/sm100 GPUs; run that comparison on one"
    from transformers.utils import is_flash_attn_4_available

    # transformers' own test, so a skip here is exactly a run transformers would refuse.
    if not is_flash_attn_4_available():
        return "flash_attention_4 is not installed here (pip install flash-attn-4: FlashAttention's CuTe kernels for sm90/sm100)"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major not in _FA4_CAPABILITIES:
        return f"flash_attention_4's CuTe kernels run on sm90/sm100; this GPU is sm{major}{minor}"
    return None


def run_with_compare(run_once: Callable[[str], RunResult], *, primary: str, references: Sequence[str], device: str) -> dict[str, RunResult]:
    """``{primary: result, reference: result, ...}`` in that order; ``run_once(implementation)`` trains once and returns its result."""
    results = {primary: _fresh_run(run_once, primary)}
    for reference in dict.fromkeys(references):  # each once, in the order given
        if reference != primary:
            results[reference] = _run_reference(run_once, reference, device=device)
    return results


def _run_reference(run_once: Callable[[str], RunResult], reference: str, *, device: str) -> RunResult:
    reason = skip_reason(reference, device=device)
    if reason is None:
        try:
            return _fresh_run(run_once, reference)
        except UnsupportedImplementation as error:
            reason = str(error)
        except torch.OutOfMemoryError as error:
            # eager materializes every document's full score matrix: expected at long contexts.
            reason = f"out of memory ({str(error).splitlines()[0]})"
    print(f"compare: {reference} skipped: {reason}")
    _free_memory()  # what the failed run allocated must not count against the next one
    return RunResult(attn_implementation=reference, skipped=reason)


def _fresh_run(run_once: Callable[[str], RunResult], implementation: str) -> RunResult:
    cudnn_attention.reset_stats()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = run_once(implementation)
    _free_memory()  # the next run starts from the same free memory
    return result


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
