"""``packed_tails.fill_past_last_document`` sets exactly the rows from ``cu_seqlens[-1]`` on, in every tensor it is
handed (each its own row count, width and dtype), and leaves the rows before them bit for bit: its torch-op version on
a CPU, its Triton kernel in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) when Triton
is installed, and compiled on a GPU (``gpu`` marker)."""

import importlib
import os

import pytest
import torch

from cudnn_attention import packed_tails
from support.child_process import run_python

CHECK = r"""
import sys, torch
from cudnn_attention import packed_tails
device, kernel = sys.argv[1], sys.argv[2] == "kernel"
if kernel:
    assert packed_tails.triton is not None
fill = packed_tails._launch if kernel else packed_tails.fill_past_last_document
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
            fill(cu, tensors[start : start + 3])
        for (got, _), want in zip(tensors, wants):
            assert torch.equal(got[: prefix[-1]].isnan(), want[: prefix[-1]].isnan()), (tokens, prefix)
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), (tokens, prefix, got.dtype)
print("tails set")
"""


def _run(device: str, mode: str, env: dict):
    return run_python(CHECK, device, mode, env={**os.environ, **env}, timeout=600)


def test_torch_ops_set_the_tail_and_nothing_before_it():
    result = _run("cpu", "torch", {})
    assert result.returncode == 0 and "tails set" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA builds of torch ship it)")
def test_kernel_sets_the_tail_and_nothing_before_it_in_the_interpreter():
    result = _run("cpu", "kernel", {"TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and "tails set" in result.stdout, result.stdout + result.stderr


@pytest.mark.gpu
def test_kernel_sets_the_tail_and_nothing_before_it_on_the_gpu():
    result = _run("cuda", "kernel", {})
    assert result.returncode == 0 and "tails set" in result.stdout, result.stdout + result.stderr


def test_empty_tensors_launch_nothing():
    cu = torch.tensor([0, 2])
    packed_tails.fill_past_last_document(cu, [(torch.empty(0, 4), 0.0)])  # would index t[0] of an empty tensor
