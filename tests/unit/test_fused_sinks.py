"""The fused (Triton) sink passes equal their torch-op definitions, bit for bit where they compute the same
float32 math: dense layouts of any stride order, packed tokens, absent rows, rows that see only the sink,
NaN and -inf sinks. On CPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set by this test before
Triton is imported) when Triton is installed; on a GPU they run compiled (``gpu`` marker)."""

import importlib
import os

import pytest

from support.child_process import run_python

CHECK = r"""
import sys, torch
from cudnn_attention import fused_sinks
assert fused_sinks.triton is not None
device = sys.argv[1]
torch.manual_seed(0)

def cases():
    B, H, S, D = 2, 3, 5, 40
    for order in ((0, 1, 2, 3), (0, 2, 1, 3)):  # (B, H, S, D) and a (B, S, H, D) buffer seen as (B, H, S, D)
        shape = [(B, H, S, D)[i] for i in order]
        out = torch.randn(shape, device=device).to(torch.bfloat16).permute(*[order.index(i) for i in range(4)])
        lse = torch.randn(B, H, S, device=device) * 3
        lse[0, :, 4] = float("-inf")  # a row whose window leaves it no key: it sees the sink alone
        absent = torch.zeros(B, 1, S, dtype=torch.bool, device=device)
        absent[1, :, 3:] = True
        yield out, lse, absent
        yield out, lse, None
    T = 11
    out = torch.randn(T, H, 64, device=device).to(torch.float16)
    lse = torch.randn(T, H, device=device)
    absent = torch.zeros(T, 1, dtype=torch.bool, device=device)
    absent[8:] = True
    yield out, lse, absent

fused_sinks._fused = lambda *a: False  # fold_sinks and sink_gradient take their torch-op definitions; _launch_* run the kernels
for sinks in (torch.randn(3, device=device), torch.tensor([0.5, float("nan"), float("-inf")], device=device)):
    for out, lse, absent in cases():
        want_out, want_lse = out.clone(), lse.clone()
        fused_sinks.fold_sinks(want_out, want_lse, sinks, absent)
        grad = torch.randn(out.shape, device=device).to(out.dtype)
        grad = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=device).copy_(grad)
        want_ds = fused_sinks.sink_gradient(grad, want_out, want_lse, sinks)
        got_lse = lse.clone()
        got_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=device).copy_(out)
        fused_sinks._launch_fold(got_out, got_lse, sinks, absent)
        got_ds = fused_sinks._launch_sink_gradient(grad, want_out, want_lse, sinks)  # the same inputs as want_ds
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6, equal_nan=True)
        # The same float32 product rounded once to out's dtype: at most one unit in the last place apart.
        torch.testing.assert_close(got_out.float(), want_out.float(), rtol=2 ** -7, atol=0, equal_nan=True)
        torch.testing.assert_close(got_ds, want_ds, rtol=1e-5, atol=1e-6, equal_nan=True)
        # Rows the kernel leaves unwritten (absent) are zero and -inf after the fold, whatever they held.
        if absent is not None:
            want_out, want_lse = out.masked_fill(absent.unsqueeze(-1), float("nan")), lse.masked_fill(absent, float("nan"))
            got_out, got_lse = want_out.clone(), want_lse.clone()
            fused_sinks.fold_sinks(want_out, want_lse, sinks, absent)
            fused_sinks._launch_fold(got_out, got_lse, sinks, absent)
            for got, want in ((got_out.float(), want_out.float()), (got_lse, want_lse)):
                torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0, equal_nan=True)
            assert got_out.masked_select(absent.unsqueeze(-1)).abs().max() == 0 and got_lse.masked_select(absent).isneginf().all()
if device == "cuda":
    # Packed folds the size of a training step, launched again and again: the compiled kernels once scaled a few
    # random rows by another row's factor (D 80-256 mostly), so one small launch could pass by luck.
    for D, dtype in ((80, torch.bfloat16), (192, torch.bfloat16), (256, torch.float16), (64, torch.bfloat16)):
        out = torch.randn(4096, 32, D, device=device).to(dtype)
        lse = torch.randn(4096, 32, device=device) * 3
        sinks = torch.randn(32, device=device) * 2
        grad = torch.randn(out.shape, device=device).to(dtype)
        want_out, want_lse = out.clone(), lse.clone()
        fused_sinks.fold_sinks(want_out, want_lse, sinks)
        terms = -torch.exp(sinks.view(1, -1) - want_lse) * (grad.float() * want_out.float()).sum(-1)
        want_ds = terms.sum(0)
        for _ in range(10):
            got_out, got_lse = out.clone(), lse.clone()
            fused_sinks._launch_fold(got_out, got_lse, sinks, None)
            torch.testing.assert_close(got_out.float(), want_out.float(), rtol=2 ** -7, atol=0)
            torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
            got_ds = fused_sinks._launch_sink_gradient(grad, want_out, want_lse, sinks)
            # Float32 sums of 4,096 terms in another order: within a few ulps of the terms' absolute sum.
            assert ((got_ds - want_ds).abs() <= 1e-5 * terms.abs().sum(0)).all(), (D, (got_ds - want_ds).abs().max())
print("fused sink passes agree")
"""


# Outputs of 2**31 elements or more (gpt-oss's 64 x 64 per token at 524,288 packed tokens): int32 offsets wrap. A
# (3, 1, 1, 8) view with a batch stride of 2**30 reaches the same offsets in one 4 GiB allocation, of which only the
# rows touched are ever paged in. Before the kernels widened such offsets, the fold wrote the last row's values outside
# the tensor (wrong values here) and the gradient's read faulted (exit status 139 in the interpreter).
WIDE_CHECK = r"""
import sys, torch
from cudnn_attention import fused_sinks
device = sys.argv[1]
torch.manual_seed(0)
D = 8
storage = torch.empty(2 * 2**30 + 2 * D, dtype=torch.bfloat16, device=device)
out = storage.as_strided((3, 1, 1, D), (2**30, D, D, 1))
grad = storage.as_strided((3, 1, 1, D), (2**30, D, D, 1), D)  # the same offsets, D elements on
values, grad_values = (torch.randn(3, 1, 1, D, device=device).to(torch.bfloat16) for _ in range(2))
out.copy_(values)
grad.copy_(grad_values)
lse, sinks = torch.randn(3, 1, 1, device=device), torch.randn(1, device=device)
assert fused_sinks._wide(fused_sinks._row_geometry(out)) and not fused_sinks._wide(fused_sinks._row_geometry(values))
fused_sinks._fused = lambda *a: False  # the torch-op definitions, on compact copies
want_out, want_lse = values.clone(), lse.clone()
fused_sinks.fold_sinks(want_out, want_lse, sinks, None)
want_ds = fused_sinks.sink_gradient(grad_values, want_out, want_lse, sinks)
got_lse = lse.clone()
fused_sinks._launch_fold(out, got_lse, sinks, None)
torch.testing.assert_close(out.float(), want_out.float(), rtol=2 ** -7, atol=0)
torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
out.copy_(want_out)
torch.testing.assert_close(fused_sinks._launch_sink_gradient(grad, out, want_lse, sinks), want_ds, rtol=1e-5, atol=1e-6)
print("fused sink passes agree past int32 offsets")
"""


# (the script, what it prints when every check held)
CHECKS = {"definitions": (CHECK, "fused sink passes agree"), "past int32 offsets": (WIDE_CHECK, "agree past int32 offsets")}


def _passes(check: str, device: str, env: dict) -> None:
    script, says = CHECKS[check]
    result = run_python(script, device, env={**os.environ, **env}, timeout=600)
    assert result.returncode == 0 and says in result.stdout, (result.returncode, result.stdout + result.stderr)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA builds of torch ship it)")
@pytest.mark.parametrize("check", list(CHECKS))
def test_fused_sink_passes_in_the_interpreter(check):
    _passes(check, "cpu", {"TRITON_INTERPRET": "1"})


@pytest.mark.gpu
@pytest.mark.parametrize("check", list(CHECKS))
def test_fused_sink_passes_on_the_gpu(check):
    _passes(check, "cuda", {})
