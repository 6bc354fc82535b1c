"""The GPU tests' check of a cuDNN call against the package's fp32 reference, within the tolerance rule
(``support.tolerances``), and the allocator poisoning that makes unwritten rows read NaN."""

import torch

import cudnn_attention
from cudnn_attention.masking import make_mask_spec
from cudnn_attention.reference import dense_reference
from support.tolerances import assert_within_lowp_noise

__all__ = ["check_against_references", "check_dense", "poison_allocator"]

DEVICE = "cuda"


def poison_allocator(*like):
    """Fill and free blocks shaped like the outputs to come, so that memory a kernel fails to write
    reads NaN rather than the zeros of freshly mapped memory."""
    junk = [torch.full_like(t, float("nan")) for t in like for _ in range(8)]
    del junk


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], grad_out)


def check_against_references(run_cudnn, run_reference, options, q, k, v, sinks):
    """Run cuDNN (strict: it must serve forward and backward) and the reference in fp32 and in the
    input dtype; every output and gradient must sit within the low-precision noise."""
    grad_out = torch.randn(q.shape[:-1] + v.shape[-1:], device=DEVICE, dtype=q.dtype)
    cudnn_attention.reset_stats()
    with cudnn_attention.strict():
        out = run_cudnn(q, k, v, sinks=sinks, **options)
        grads = _grads(out, (q, k, v, sinks), grad_out)
    assert cudnn_attention.stats()["cudnn_forward"] == 1 and cudnn_attention.stats()["cudnn_backward"] == 1
    mask = make_mask_spec(
        causal=options.get("causal", False),
        bottom_right=options.get("bottom_right", False),
        window_size=options.get("window_size", (-1, -1)),
    )
    scale = q.shape[-1] ** -0.5 if options.get("scale") is None else options["scale"]  # the call's scale; None: 1 / sqrt(D)
    results = {}
    for dtype in (torch.float32, q.dtype):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in (q, k, v)]
        sink_leaf = None if sinks is None else sinks.detach().clone().to(dtype).requires_grad_()
        ref, _ = run_reference(*leaves, scale=scale, mask=mask, sinks_H=sink_leaf, compute_dtype=dtype)
        results[dtype] = (ref, _grads(ref, (*leaves, sink_leaf), grad_out.to(ref.dtype)))
    (ref, ref_grads), (lowp, lowp_grads) = results[torch.float32], results[q.dtype]
    assert_within_lowp_noise("out", out, ref, lowp)
    for name, got, want, base in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, lowp_grads):
        assert_within_lowp_noise(name, got, want, base)
    return out, grads


def check_dense(options, q, k, v, sinks, seqlens=(None, None)):
    return check_against_references(
        lambda *t, **kw: cudnn_attention.attention(*t, seqlens_q=seqlens[0], seqlens_kv=seqlens[1], **kw),
        lambda *t, **kw: dense_reference(*t, seqlens_q_B=seqlens[0], seqlens_kv_B=seqlens[1], **kw),
        options,
        q,
        k,
        v,
        sinks,
    )
