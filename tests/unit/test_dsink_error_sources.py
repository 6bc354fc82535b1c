"""The dSink error's sources (``support.reference64.dsinks_error_sources``), which a failing GPU dSink check reports: an
error planted in O or in the LSE is attributed to it, with its size, and nothing to the other."""

import math

import pytest
import torch

from support.reference64 import dsinks_error_sources, flash_style_dsinks, reference_attention


@pytest.fixture
def exact():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 48, 32, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, dtype=torch.float64)
    out, lse = reference_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    grad_out = torch.randn_like(out)
    dsinks = flash_style_dsinks(out, lse, grad_out, sinks, torch.float64)
    return out, lse, grad_out, sinks, dsinks


def test_a_scaled_output_is_the_outputs_error(exact):
    out, lse, grad_out, sinks, dsinks = exact
    sources = dsinks_error_sources(out * 1.01, lse, out, lse, grad_out, sinks)
    # dSink is linear in O: scaling O by 1.01 moves it by exactly 1 % of itself.
    assert sources["by_out"] == pytest.approx(0.01 * dsinks.abs().max().item(), rel=1e-9)
    assert sources["out_scale"] == pytest.approx(0.01, rel=1e-9)
    assert sources["by_lse"] == 0.0 and sources["lse_shift"] == 0.0


def test_a_shifted_lse_is_the_lses_error(exact):
    out, lse, grad_out, sinks, dsinks = exact
    sources = dsinks_error_sources(out, lse + 0.01, out, lse, grad_out, sinks)
    # Every sink weight exp(sink - lse) shrinks by exp(-0.01).
    assert sources["by_lse"] == pytest.approx((1 - math.exp(-0.01)) * dsinks.abs().max().item(), rel=1e-9)
    assert sources["lse_shift"] == pytest.approx(0.01, rel=1e-9)
    assert sources["by_out"] == 0.0 and sources["out_scale"] == 0.0


def test_without_a_returned_lse_only_the_output_is_judged(exact):
    out, lse, grad_out, sinks, _ = exact
    sources = dsinks_error_sources(out, None, out, lse, grad_out, sinks)
    assert sources["by_lse"] is None and sources["lse_shift"] is None and sources["by_out"] == 0.0
