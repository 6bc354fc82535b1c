"""Under ``torch.compile`` no plan is resolved while tracing, so a configuration cuDNN rejects reaches the op itself:
the op then computes it on the exact path (counted, warned about, refused in strict mode) instead of failing. On CPU,
with the ops' real kernels registered for CPU and every graph rejected (``emulated_cudnn``)."""

import pytest
import torch

import cudnn_attention
from cudnn_attention import cudnn_ops
from cudnn_attention.graph_build import GraphRejected
from support.emulated_cudnn import emulated
from support.reference64 import reference_attention, reference_varlen_attention

REASON = "cuDNN rejected the forward graph: rejected in this test"


def _rejecting(monkeypatch):
    def reject(*args, **kwargs):
        raise GraphRejected(REASON)

    monkeypatch.setattr(cudnn_ops, "build_plan", reject)
    monkeypatch.setattr(cudnn_ops, "backward_graph", reject)


@pytest.mark.parametrize("packed", [False, True])
def test_a_rejected_configuration_under_compile_takes_the_exact_path_in_the_op(packed, monkeypatch):
    torch.manual_seed(0)
    if packed:
        q, k, v = (torch.randn(13, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
        cu = torch.tensor([0, 5, 6, 11], dtype=torch.int32)  # a length-1 document and a capacity tail of 2
        call_args, reference = (cu, cu, 5, 5), reference_varlen_attention
    else:
        q, k, v = (torch.randn(2, h, 7, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
        call_args, reference = (), reference_attention
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    w_out, w_lse = torch.randn(q.shape, dtype=torch.float64), torch.randn(q.shape[:-1], dtype=torch.float64)
    options = dict(causal=True, window_size=(3, 0), sinks=sinks, return_lse=True)

    def loss_fn(attend, q, k, v, sinks):
        out, lse = attend(q, k, v, *call_args, **{**options, "sinks": sinks})
        return (out * w_out).sum() + (torch.where(lse == float("-inf"), 0.0, lse) * w_lse).sum()

    inputs = (q, k, v, sinks)
    want = torch.autograd.grad(loss_fn(reference, *inputs), inputs)
    attend = cudnn_attention.varlen_attention if packed else cudnn_attention.attention
    with emulated(monkeypatch, op=True) as launches:
        _rejecting(monkeypatch)
        compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
        with pytest.warns(cudnn_attention.CudnnAttentionFallbackWarning, match="rejected in this test"):
            got = torch.autograd.grad(compiled(attend, *inputs), inputs)
        stats = cudnn_attention.stats()
        assert (launches["forward"], launches["backward"]) == (0, 0)
        assert stats["fallback_forward"] == {REASON: 1} and stats["fallback_backward"] == {REASON: 1}, stats
        for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
            # The ops carry the sinks as float32 (the kernels' operand), so float32 rounding is what is left.
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        torch._dynamo.reset()
        with cudnn_attention.strict(), pytest.raises(cudnn_attention.StrictModeError, match="rejected in this test"):
            compiled(attend, *inputs)
    torch._dynamo.reset()
