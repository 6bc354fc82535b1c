"""``packed_rows.fill_past_last_document`` sets exactly the rows from ``cu_seqlens[-1]`` on, and ``packed_rows.fill_rows``
exactly the rows its masks mark, in every tensor each is handed (each its own row count, width and dtype), and both
leave the other rows bit for bit: their torch-op version on a CPU, their Triton kernel in Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported) when Triton is installed, and compiled on a GPU (``gpu``
marker)."""

import importlib
import os

import pytest
import torch

from cudnn_attention import packed_rows
from support.child_process import run_python

CHECK = r"""
import sys, torch
from cudnn_attention import packed_rows
device, kernel = sys.argv[1], sys.argv[2] == "kernel"
if kernel:
    assert packed_rows.triton is not None
    tail = lambda cu, fills: packed_rows._launch([(t, None, value) for t, value in fills], cu)
    masked = lambda fills: packed_rows._launch(fills, None)
else:
    tail, masked = packed_rows.fill_past_last_document, packed_rows.fill_rows
torch.manual_seed(0)
# (tokens, prefix sums): a tail after an empty document, none, all tokens in the tail, a long tail of a wide tensor.
LAYOUTS = ((11, [0, 3, 3, 8]), (11, [0, 11]), (5, [0, 0]), (3000, [0, 100, 1999]))
for tokens, prefix in LAYOUTS:
    for index_dtype in (torch.int32, torch.int64):
        cu = torch.tensor(prefix, dtype=index_dtype, device=device)
        # An output, an LSE of one head (width 1) and a dK with more tokens than the queries (its own T).
        tensors = [
            (torch.randn(tokens, 3, 40, device=device).to(torch.bfloat16), 0.0),
            (torch.randn(tokens, 1, device=device), float("-inf")),
            (torch.randn(tokens + 4, 2, 64, device=device).half(), 0.0),
            (torch.full((tokens, 2, 8), float("nan"), device=device), 0.0),
        ]
        wants = []
        for t, value in tensors:
            want = t.clone()
            want[prefix[-1]:] = value
            wants.append(want)
        for start in range(0, len(tensors), 3):  # one launch takes three tensors
            tail(cu, tensors[start : start + 3])
        for (got, _), want in zip(tensors, wants):
            assert torch.equal(got[: prefix[-1]].isnan(), want[: prefix[-1]].isnan()), (tokens, prefix)
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), (tokens, prefix, got.dtype)
# Masks: random rows (none, all, some), each tensor its own, of shape (T,) or (T, 1) as the launch code passes them.
for tokens in (1, 11, 3000):
    for share in (0.0, 1.0, 0.3):
        tensors = [
            torch.randn(tokens, 3, 40, device=device).to(torch.bfloat16),
            torch.randn(tokens, 1, device=device),
            torch.randn(tokens + 4, 2, 64, device=device).half(),
            torch.full((tokens, 2, 8), float("nan"), device=device),
        ]
        fills = [(t, torch.rand(t.shape[0], *[1] * (i % 2), device=device) < share, value)
                 for i, (t, value) in enumerate(zip(tensors, (0.0, float("-inf"), 0.0, 0.0)))]
        wants = [t.clone().masked_fill_(rows.reshape(-1, *[1] * (t.dim() - 1)), value) for t, rows, value in fills]
        for start in range(0, len(fills), 3):
            masked(fills[start : start + 3])
        for t, want in zip(tensors, wants):
            assert torch.equal(t.isnan(), want.isnan()), (tokens, share)
            assert torch.equal(t.nan_to_num(), want.nan_to_num()), (tokens, share, t.dtype)
print("rows set")
"""


def _run(device: str, mode: str, env: dict):
    return run_python(CHECK, device, mode, env={**os.environ, **env}, timeout=600)


def test_torch_ops_set_their_rows_and_no_other():
    result = _run("cpu", "torch", {})
    assert result.returncode == 0 and "rows set" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA builds of torch ship it)")
def test_kernel_sets_its_rows_and_no_other_in_the_interpreter():
    result = _run("cpu", "kernel", {"TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and "rows set" in result.stdout, result.stdout + result.stderr


@pytest.mark.gpu
def test_kernel_sets_its_rows_and_no_other_on_the_gpu():
    result = _run("cuda", "kernel", {})
    assert result.returncode == 0 and "rows set" in result.stdout, result.stdout + result.stderr


def test_empty_tensors_launch_nothing():
    cu = torch.tensor([0, 2])
    packed_rows.fill_past_last_document(cu, [(torch.empty(0, 4), 0.0)])  # would index t[0] of an empty tensor
    packed_rows.fill_rows([(torch.empty(0, 4), torch.empty(0, dtype=torch.bool), 0.0)])
