"""Which input dtypes each path serves: the one table every place that decides reads.

A row per dtype: whether cuDNN's forward and backward graphs take it (and the frontend's name for it), and the dtype the
exact path computes it in (float64 in float64, so that ``torch.autograd.gradcheck`` holds; every other dtype in float32).
A dtype missing from the table is not a floating-point input the package serves at all (validation refuses it). Sinks
are any floating dtype and enter every path as float32 (float64 on the exact path for float64 inputs).

An opt-in dtype (FP8 on Blackwell, say) is one more row here; what reads the table (the plan's predicate, the graph's I/O
type, the exact path's math, the transformers layer's cast) follows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DTYPES", "DtypeRow", "cudnn_dtypes", "cudnn_serves", "exact_math_dtype"]


class DtypeRow(NamedTuple):
    """What each path does with one input dtype."""

    cudnn_forward: bool  # cuDNN's forward graph takes it (as its I/O type)
    cudnn_backward: bool  # cuDNN's backward graph takes it
    cudnn_name: str | None  # the frontend's ``cudnn.data_type`` member for it
    exact_math: torch.dtype  # what the exact path computes it in (and its LSE's dtype)


DTYPES = {
    torch.float16: DtypeRow(cudnn_forward=True, cudnn_backward=True, cudnn_name="HALF", exact_math=torch.float32),
    torch.bfloat16: DtypeRow(cudnn_forward=True, cudnn_backward=True, cudnn_name="BFLOAT16", exact_math=torch.float32),
    # cuDNN's float32 SDPA is neither faster than torch's nor exact: the exact path serves float32, visibly.
    torch.float32: DtypeRow(cudnn_forward=False, cudnn_backward=False, cudnn_name=None, exact_math=torch.float32),
    torch.float64: DtypeRow(cudnn_forward=False, cudnn_backward=False, cudnn_name=None, exact_math=torch.float64),
}


def cudnn_serves(dtype: torch.dtype, *, backward: bool) -> bool:
    """Whether cuDNN's graphs take ``dtype`` inputs: the forward, and the backward too when ``backward``."""
    row = DTYPES.get(dtype)
    return row is not None and row.cudnn_forward and (row.cudnn_backward or not backward)


def cudnn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes cuDNN's forward graphs take, in the table's order (what a caller casts mixed inputs to)."""
    return tuple(dtype for dtype, row in DTYPES.items() if row.cudnn_forward)


def exact_math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the exact path computes ``dtype`` inputs in: float64 for float64, float32 for the rest (a dtype outside
    the table too). Applied to the math's own dtype it also gives the LSE's and the gathered outputs'."""
    row = DTYPES.get(dtype)
    return torch.float32 if row is None else row.exact_math
