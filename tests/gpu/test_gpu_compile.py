"""torch.compile(fullgraph=True) on the GPU without stand-ins: the exact path (float32 CUDA inputs), a backward cuDNN
is refused for (``cudnn_attention.errata``: computed inside the op), and strict mode, each against the eager call."""

import itertools

import pytest
import torch

import cudnn_attention

pytestmark = pytest.mark.gpu


def _grads(fn, inputs, weight):
    out = fn(*inputs)
    return out, torch.autograd.grad((out.float() * weight).sum(), inputs)


def test_float32_on_the_gpu_compiles_and_counts_each_call():
    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 64, 32, device="cuda", requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    weight = torch.randn(2, 4, 64, 32, device="cuda")

    def attend(q, k, v, sinks):
        return cudnn_attention.attention(q, k, v, causal=True, window_size=(7, 0), sinks=sinks)

    want_out, want = _grads(attend, (q, k, v, sinks), weight)
    cudnn_attention.reset_stats()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        got_out, got = _grads(compiled, (q, k, v, sinks), weight)
    torch.testing.assert_close(got_out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    stats = cudnn_attention.stats()
    assert sum(stats["fallback_forward"].values()) == 2 and sum(stats["fallback_backward"].values()) == 2, stats
    with cudnn_attention.strict(), pytest.raises(cudnn_attention.StrictModeError):
        compiled(q, k, v, sinks)
    torch._dynamo.reset()


def test_a_refused_backward_under_compile_is_computed_exactly_inside_the_op():
    # Packed D 256 with D_v 128: cuDNN serves the forward; its backward is known wrong (errata: packed-d256-other-dv-backward).
    torch._dynamo.reset()
    torch.manual_seed(0)
    lengths = [100, 1, 300, 57]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    T = sum(lengths) + 3
    q, k = (torch.randn(T, h, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2))
    v = torch.randn(T, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(T, 8, 128, device="cuda")

    def attend(q, k, v):
        return cudnn_attention.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    _, want = _grads(attend, (q, k, v), weight)  # eager: the whole call takes the exact path
    cudnn_attention.reset_stats()
    _, got = _grads(torch.compile(attend, fullgraph=True, backend="aot_eager"), (q, k, v), weight)
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] == 1 and stats["cudnn_backward"] == 0, stats
    assert any("D 256" in reason for reason in stats["fallback_backward"]), stats
    for g, w in zip(got, want):  # both computed by the exact path from the same inputs
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()
