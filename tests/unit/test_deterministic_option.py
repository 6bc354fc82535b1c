"""The per-call ``deterministic`` option: it picks the backward graph's algorithm for that call alone, eager and through
the ops, and a value of another type is refused with its name; on CPU with emulated graphs (``emulated_cudnn``)."""

import pytest
import torch

import cudnn_attention
from support.emulated_cudnn import emulated


@pytest.fixture(params=["eager", "op"])
def backward_algorithms(monkeypatch, request):
    """Emulated cuDNN, served by the eager bypass or through the ops; yields the algorithm (``deterministic``) of
    every backward graph launched."""
    with emulated(monkeypatch, op=request.param == "op") as launches:
        yield launches["algorithms"]


def _leaves(packed: bool):
    torch.manual_seed(0)
    shape = (12, 4, 8) if packed else (1, 4, 6, 8)
    return [torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "setting, global_setting, want", [(None, False, False), (None, True, True), (True, False, True), (False, True, False)]
)
def test_the_option_overrides_torchs_setting_for_its_call(backward_algorithms, monkeypatch, packed, setting, global_setting, want):
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: global_setting)
    q, k, v = _leaves(packed)
    if packed:
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        out = cudnn_attention.varlen_attention(q, k, v, cu, cu, 7, 7, causal=True, deterministic=setting)
    else:
        out = cudnn_attention.attention(q, k, v, causal=True, deterministic=setting)
    out.sum().backward()
    assert backward_algorithms == [want]


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_another_type_is_refused_by_name(value):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=f"deterministic must be a bool or None, got {value!r}"):
        cudnn_attention.attention(q, q, q, deterministic=value)
