"""Gradients the math makes exactly zero stay exactly zero on the cuDNN path, on CPU with emulated graphs.

When no query row can see more than one key (one key in a dense call, or the band ``(0, 0)``) and there are no sinks,
every probability is 1 and the output's gradient reaches neither the scores nor q and k: dQ and dK are 0. cuDNN's
backward computes ``dP - D`` from two float32 sums taken in different orders, so its dK came out 2.2e-4 on an H200
(B 1, S_q 1500, one key, D 192, scale 1, causal). The emulated graph here adds such a residue to dQ and dK, as the
kernel does; the launch code must hand back exact zeros, and leave dV (``P^T dO``) and the LSE's own gradient alone.
"""

import pytest
import torch

import cudnn_attention
from support import emulated_cudnn
from support.emulated_cudnn import emulated
from support.reference64 import reference_attention

RESIDUE = 2.2e-4


@pytest.fixture
def rounding_residue(monkeypatch):
    backward = emulated_cudnn._backward

    def with_residue(graph, operands):
        backward(graph, operands)
        for grad in operands[6:8]:  # dq, dk
            grad.add_(RESIDUE)

    monkeypatch.setattr(emulated_cudnn, "_backward", with_residue)


def _dense(S_q, S_kv, *, sinks=False):
    torch.manual_seed(0)
    q = torch.randn(1, 4, S_q, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, S_kv, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True) if sinks else None
    return q, k, v, sink


@pytest.mark.parametrize("S_kv, options", [(1, dict(causal=True, scale=1.0)), (1, {}), (9, dict(window_size=(0, 0)))])
def test_rows_that_see_one_key_give_exactly_zero_dq_and_dk(S_kv, options, rounding_residue, monkeypatch):
    q, k, v, _ = _dense(9, S_kv)
    grad = torch.randn(1, 4, 9, 16, dtype=torch.float64)
    with emulated(monkeypatch):
        out = cudnn_attention.attention(q, k, v, **options)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    assert dq.abs().max() == 0 and dk.abs().max() == 0
    want = torch.autograd.grad(reference_attention(q, k, v, **options), (q, k, v), grad)
    assert want[0].abs().max() < 1e-12 and want[1].abs().max() < 1e-12  # what the float64 reference says, to its rounding
    # dV = P^T dO: a real gradient, left as the kernel wrote it (P from a float32 LSE: 1 to float32 rounding).
    torch.testing.assert_close(dv, want[2], rtol=1e-5, atol=1e-5)


def test_with_sinks_or_more_keys_the_kernel_gradient_stays(rounding_residue, monkeypatch):
    for S_kv, sinks in ((1, True), (9, False)):
        q, k, v, sink = _dense(9, S_kv, sinks=sinks)
        with emulated(monkeypatch):
            out = cudnn_attention.attention(q, k, v, causal=True, sinks=sink)
            dq, dk, _ = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert dq.abs().max() > 0 and dk.abs().max() > 0  # a real gradient (plus the emulated residue), not zeroed


def test_the_lse_gradient_still_reaches_q_and_k(rounding_residue, monkeypatch):
    q, k, v, _ = _dense(9, 1)
    with emulated(monkeypatch):
        out, lse = cudnn_attention.attention(q, k, v, return_lse=True)
        dq, dk = torch.autograd.grad(out.sum() + lse.sum(), (q, k))
    # d lse / d score = P = 1: dQ = scale * k and dK = scale * sum of q over the rows, plus the emulated residue once.
    torch.testing.assert_close(dq, (k.detach() * 16**-0.5).repeat_interleave(2, dim=1).expand_as(dq) + RESIDUE)
