"""CPU stand-ins for the ops the provider's kernels call, so that the kernels run on a CPU-only torch.

The provider's kernels are CUDA kernels. Registered at the CPU key instead, with
``cudnn_attention::forward``/``backward`` served by the exact reference below, they run torch's
autograd formulas, our argument handling and the ops they call end to end: what differs on a GPU
is only the cuDNN computation, which tests/test_gpu_provider.py checks.
"""

import contextlib
import threading

import torch
import torch.nn.functional as F

from cudnn_attention import _compat
from cudnn_attention import plan as plans
from cudnn_attention.layouts import allocate_forward_outputs
from cudnn_attention.masking import MaskSpec
from cudnn_attention.reference import dense_reference, varlen_reference


def _defined_varlen_ops() -> tuple[str, ...]:
    """The ``torch_attn`` varlen ops this torch defines: none in 2.9 (no varlen API), no ``_out`` in 2.10 and 2.11."""
    try:
        import torch.nn.attention.varlen  # noqa: F401 - defines the torch_attn ops
    except ImportError:
        return ()
    names = ("_varlen_attn", "_varlen_attn_out", "_varlen_attn_backward")
    # hasattr on an op namespace is True only for ops that exist.
    return tuple(f"torch_attn::{name}" for name in names if hasattr(torch.ops.torch_attn, name))


# The CUDA kernels the provider overrides on this torch.
DENSE_OPS = ("aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward")
VARLEN_OPS = _defined_varlen_ops()


def per_document_reference(q, k, v, cu_q, cu_kv, grad_out=None, *, left):
    """Packed (T, H, D) CPU attention with torch's math, each document on its own, the causal diagonal at its last
    query and key (bottom right; queries are the last keys' positions) and ``left`` keys back visible (None: all).
    Returns ``(out, [dq, dk, dv])`` for ``grad_out``, or ``(out, None)`` without it. Every token is in a document."""
    out, grads = torch.empty_like(q), [torch.empty_like(t) for t in (q, k, v)]
    lengths_q, lengths_kv = ((cu[1:] - cu[:-1]).tolist() for cu in (cu_q, cu_kv))
    for doc, (len_q, len_kv) in enumerate(zip(lengths_q, lengths_kv)):
        rows_q, rows_kv = slice(cu_q[doc], cu_q[doc + 1]), slice(cu_kv[doc], cu_kv[doc + 1])
        part = [t.detach()[rows].transpose(0, 1).unsqueeze(0).requires_grad_() for t, rows in ((q, rows_q), (k, rows_kv), (v, rows_kv))]
        i, j = torch.arange(len_q).view(-1, 1) + (len_kv - len_q), torch.arange(len_kv).view(1, -1)
        visible = (j <= i) & (j >= i - left) if left is not None else j <= i
        doc_out = F.scaled_dot_product_attention(*part, attn_mask=visible)
        out[rows_q] = doc_out[0].transpose(0, 1).detach()
        if grad_out is not None:
            doc_grads = torch.autograd.grad(doc_out, part, grad_out[rows_q].transpose(0, 1).unsqueeze(0))
            for grad, doc_grad, rows in zip(grads, doc_grads, (rows_q, rows_kv, rows_kv)):
                grad[rows] = doc_grad[0].transpose(0, 1)
    return out, grads if grad_out is not None else None


def in_fresh_thread(fn):
    # Kernels run below autograd (its dispatch keys are excluded in this thread's TLS); a new
    # thread starts with autograd on, which is all a stand-in backward needs.
    result = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0]


def _reference(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, mask: MaskSpec):
    if cu_q is None:
        return dense_reference(q, k, v, scale=scale, mask=mask)
    return varlen_reference(q, k, v, cu_q, cu_kv, max_q, max_kv, scale=scale, mask=mask)


def _forward_output(q, v, *, packed: bool) -> torch.Tensor:
    # The buffer the real forward writes its output into (the layout its backward graph reads), uninitialized.
    return allocate_forward_outputs(q, v, packed=packed, need_lse=False, zero_tails=False)[0]


def assert_token_major(q, k, v, *, packed: bool) -> None:
    """What every stand-in for a cuDNN launch checks: cuDNN's packed backward reads q, k, v right only as compact
    token-major tensors (layouts.token_major)."""
    assert not packed or all(t.is_contiguous() for t in (q, k, v)), [t.stride() for t in (q, k, v)]


def standin_forward(
    q, k, v, sinks=None, seqlens_q=None, seqlens_kv=None, cu_q=None, cu_kv=None, *, scale, max_seqlen_q=0, max_seqlen_kv=0, **options
):
    need_lse = options.pop("need_lse", False)
    assert_token_major(q, k, v, packed=cu_q is not None)
    exact, lse = _reference(q, k, v, cu_q, cu_kv, max_seqlen_q, max_seqlen_kv, scale, MaskSpec.from_op_args(options))
    out = _forward_output(q, v, packed=cu_q is not None).copy_(exact)
    return out, lse if need_lse else torch.empty(0)


def standin_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    grad_lse=None,
    sinks=None,
    seqlens_q=None,
    seqlens_kv=None,
    cu_q=None,
    cu_kv=None,
    *,
    scale,
    max_seqlen_q=0,
    max_seqlen_kv=0,
    deterministic=False,
    **mask_options,
):
    mask = MaskSpec.from_op_args(mask_options)
    # The real backward reads lse with our forward's layout: (B, H, S) dense, (T, H) packed, contiguous; and the output
    # as its graph was built for it (graph_spec.spec_for): our forward's layout too.
    expected = (q.shape[0], q.shape[1]) if cu_q is not None else (q.shape[0], q.shape[1], q.shape[2])
    assert tuple(lse.shape) == expected and lse.is_contiguous() and lse.dtype == torch.float32, (lse.shape, lse.stride())
    assert out.stride() == _forward_output(q, v, packed=cu_q is not None).stride(), (out.shape, out.stride(), q.stride())
    assert_token_major(q, k, v, packed=cu_q is not None)
    # torch's autograd formulas above the provider's kernels drop their LSE's gradient: none ever reaches this op.
    assert grad_lse is None and grad_out is not None

    def grads():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = _reference(*inputs, cu_q, cu_kv, max_seqlen_q, max_seqlen_kv, scale, mask)
        return torch.autograd.grad(out, inputs, grad_out)

    dq, dk, dv = in_fresh_thread(grads)
    return dq, dk, dv, torch.empty(0)


@contextlib.contextmanager
def our_ops_on_cpu(monkeypatch):
    """``cudnn_attention::forward``/``backward`` at the CPU key (the reference), and cuDNN accepting every call."""
    monkeypatch.setattr(plans, "resolve", lambda *args, **kwargs: (None, None))  # "cuDNN serves it"
    ours = torch.library.Library("cudnn_attention", "IMPL")
    ours.impl("forward", standin_forward, "CPU")
    ours.impl("backward", standin_backward, "CPU")
    try:
        yield
    finally:
        _compat.destroy_library(ours)
