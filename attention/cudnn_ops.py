"""The ``cudnn_attention::forward`` / ``cudnn_attention::backward`` custom ops, and the eager bypass around them.

Defined with the low-level ``torch.library.Library`` API (the decorator form costs about 40 us more per call),
with fake kernels that allocate through the same helpers as the real ones and an autograd formula, so the ops
work under ``torch.compile(fullgraph=True)`` and CUDA-graph capture. Their arguments have names and defaults
(``OP_TAIL_SCHEMA`` in :mod:`cudnn_attention.call`, which also writes and reads the one flat form of a call);
the options are keyword-only:

    torch.ops.cudnn_attention.forward(q, k, v, sinks, cu_seqlens_q=cu, cu_seqlens_kv=cu, scale=0.125,
                                      max_seqlen_q=512, max_seqlen_kv=512, window_right=0, need_lse=True)

The returned LSE is differentiable (FlashAttention 4 does the same; torchtitan trains gpt-oss sinks as
``out * sigmoid(lse - sink)`` over a sink-less kernel). cuDNN's backward graph takes no dLSE, so its share
comes from one more launch of the same graph (see :func:`cudnn_attention.launch.run_backward`), only when a
loss uses the LSE: an unused output reaches the backward as None (``set_materialize_grads(False)``). Under
``torch.compile`` an LSE returned out of the compiled region and left unused reaches it as zeros (AOT
autograd materializes its outputs' gradients): that launch then runs and adds zero.

A plain eager call skips the dispatcher (:class:`_EagerAttention`); ``torch.compile``, dispatch modes and
tensor subclasses see the ops.
"""

from __future__ import annotations

import torch

from . import _compat
from .call import AttentionCall, Lengths
from .graph_build import GraphRejected
from .launch import run_backward, run_forward
from .layouts import allocate_backward_outputs, allocate_forward_outputs
from .op_args import OP_TAIL_SCHEMA, from_op_args, op_args
from .operands import aligned
from .plan import Plan, backward_graph, build_plan
from .policy import note_fallback
from .reference import exact_attention

__all__ = ["cudnn_backward", "cudnn_forward"]

_lib = torch.library.Library("cudnn_attention", "FRAGMENT")
_lib.define(f"forward(Tensor q, Tensor k, Tensor v, {OP_TAIL_SCHEMA}, bool need_lse=False) -> (Tensor out, Tensor lse)")
_lib.define(
    "backward(Tensor? grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse=None, "
    f"{OP_TAIL_SCHEMA}) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)"
)


def _empty_float32(q):
    # An op must return a tensor where the eager path has None (no LSE asked for, no sinks to differentiate);
    # the fake kernels return the same empty placeholder.
    return torch.empty((0,), dtype=torch.float32, device=q.device)


# ----------------------------------------------------------------------------------------------
# Real kernels
# ----------------------------------------------------------------------------------------------


def _forward_cuda(
    q, k, v, sinks=None, seqlens_q=None, seqlens_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None, *, need_lse=False, **options
):
    q, k, v = aligned(q, "q"), aligned(k, "k"), aligned(v, "v")
    call, lengths = from_op_args(
        q,
        k,
        need_lse=need_lse,
        grad=False,
        sinks=sinks,
        seqlens_q=seqlens_q,
        seqlens_kv=seqlens_kv,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        **options,
    )
    try:
        plan = build_plan(q, k, v, call, deterministic=False)
    except GraphRejected as rejected:
        return _exact_forward(call, q, k, v, sinks, lengths, str(rejected))
    out, lse = run_forward(plan, q, k, v, sinks, lengths, need_lse)
    return out, lse if lse is not None else _empty_float32(q)


def _backward_cuda(
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
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    **options,
):
    call, lengths = from_op_args(
        q,
        k,
        need_lse=True,
        grad=True,
        sinks=sinks,
        seqlens_q=seqlens_q,
        seqlens_kv=seqlens_kv,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        **options,
    )
    # The op saved its inputs as given: the forward ran on aligned copies of any that were not.
    q, k, v, out = aligned(q, "q"), aligned(k, "k"), aligned(v, "v"), aligned(out, "out")
    try:
        graph = backward_graph(q, k, v, call, deterministic=call.backward_deterministic())
    except GraphRejected as rejected:
        return _exact_backward(call, grad_out, grad_lse, q, k, v, sinks, lengths, str(rejected))
    dq, dk, dv, dsinks = run_backward(graph, grad_out, q, k, v, out, lse, sinks, lengths, grad_lse)
    return dq, dk, dv, dsinks if dsinks is not None else _empty_float32(q)


# Inside the ops a configuration cuDNN rejects takes the exact path itself: under torch.compile no plan is resolved
# while tracing (plan.resolve answers (None, None)), so the op is all the compiled graph has. Counted, warned about
# and refused in strict mode like an eager fallback, each time the op runs; outputs in the layouts the fake kernels
# promised the compiled graph.


def _exact_forward(call: AttentionCall, q, k, v, sinks, lengths: Lengths, reason: str):
    note_fallback("forward", reason, caller_depth=0)
    exact_out, exact_lse = exact_attention(call, q, k, v, sinks=sinks, lengths=lengths)
    out, lse = allocate_forward_outputs(q, v, packed=call.packed, need_lse=call.need_lse)
    out.copy_(exact_out)
    if lse is None:
        return out, _empty_float32(q)
    return out, lse.copy_(exact_lse)


def _exact_backward(call: AttentionCall, grad_out, grad_lse, q, k, v, sinks, lengths: Lengths, reason: str):
    note_fallback("backward", reason, caller_depth=0)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v) + (() if sinks is None else (sinks,))]
        out, lse = exact_attention(call, *leaves[:3], sinks=None if sinks is None else leaves[3], lengths=lengths)
        used = [(output, grad) for output, grad in ((out, grad_out), (lse, grad_lse)) if grad is not None]
        grads = torch.autograd.grad([output for output, _ in used], leaves, [grad for _, grad in used], allow_unused=True)
    dq, dk, dv = allocate_backward_outputs(q, k, v, packed=call.packed, padded=call.padded)
    for into, grad in zip((dq, dk, dv), grads):
        if grad is None:  # a loss over the LSE alone does not reach V
            into.zero_()
        else:
            into.copy_(grad)
    dsinks = None if sinks is None else (grads[3] if grads[3] is not None else torch.zeros_like(sinks))
    return dq, dk, dv, dsinks if dsinks is not None else _empty_float32(q)


_lib.impl("forward", _forward_cuda, "CUDA")
_lib.impl("backward", _backward_cuda, "CUDA")


# ----------------------------------------------------------------------------------------------
# Fake kernels and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.register_fake("cudnn_attention::forward", lib=_lib)
def _forward_fake(
    q, k, v, sinks=None, seqlens_q=None, seqlens_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None, *, need_lse=False, **options
):
    out, lse = allocate_forward_outputs(q, v, packed=cu_seqlens_q is not None, need_lse=need_lse)
    return out, lse if lse is not None else _empty_float32(q)


@torch.library.register_fake("cudnn_attention::backward", lib=_lib)
def _backward_fake(
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
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    **options,
):
    dq, dk, dv = allocate_backward_outputs(q, k, v, packed=cu_seqlens_q is not None, padded=seqlens_q is not None)
    return dq, dk, dv, torch.empty((sinks.shape[0],), dtype=torch.float32, device=q.device) if sinks is not None else _empty_float32(q)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, sinks, *index_tensors = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, *index_tensors)
    ctx.options = {name: value for name, value in keyword_only_inputs.items() if name != "need_lse"}
    # The LSE is differentiable; an output the loss does not use arrives as None, so a loss without the LSE
    # costs nothing more (see launch.run_backward).
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, grad_out, grad_lse):
    q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return None, None, None, None, None, None, None, None
    # The call's deterministic option as given: None is resolved when the backward op runs, not when it is traced.
    dq, dk, dv, dsinks = torch.ops.cudnn_attention.backward(
        grad_out, q, k, v, out, lse, grad_lse, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, **ctx.options
    )
    return dq, dk, dv, dsinks if sinks is not None else None, None, None, None, None


torch.library.register_autograd("cudnn_attention::forward", _backward_formula, setup_context=_setup_context, lib=_lib)


# ----------------------------------------------------------------------------------------------
# The eager bypass
# ----------------------------------------------------------------------------------------------


class _EagerAttention(torch.autograd.Function):
    """The eager training call without the dispatcher: the op's autograd wrapper costs about 100 us of host time per
    forward on an H200, this a few (docs/decisions/0003-eager-calls-bypass-the-dispatcher.md). Same kernels, same saved
    tensors and the same backward as the op; the plan, backward graph included, was resolved before the call. The
    ``forward(ctx, ...)`` form on purpose: with ``setup_context`` every apply binds the signature with ``inspect``
    (about 60 us); functorch transforms, which need that form, take the op instead. The index tensors travel as one
    ``lengths`` argument: ``apply`` costs per argument."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, call, lengths):
        out, lse = run_forward(plan, q, k, v, sinks, lengths, True)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *lengths.tensors())
        ctx.plan, ctx.call, ctx.batch = plan, call, lengths.batch
        ctx.set_materialize_grads(False)  # the LSE is differentiable; an unused output's gradient arrives as None
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None, None, None
        # The prefix sums are saved so that an in-place write since the forward is caught; the batch carries them.
        q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, _, _ = ctx.saved_tensors
        lengths = Lengths(seqlens_q=seqlens_q, seqlens_kv=seqlens_kv, batch=ctx.batch)
        graph, deterministic = ctx.plan.backward, ctx.call.backward_deterministic()
        if ctx.plan.deterministic != deterministic:  # torch's setting changed since the forward (the op path resolves per backward too)
            graph = backward_graph(q, k, v, ctx.call, deterministic=deterministic)
        dq, dk, dv, dsinks = run_backward(graph, grad_out, q, k, v, out, lse, sinks, lengths, grad_lse)
        return dq, dk, dv, dsinks, None, None, None


# Function.apply's Python layer (torch <= 2.13) binds signatures and unwraps functorch wrappers, neither needed where
# _eager_safe holds.
_eager_attention = _compat.autograd_apply(_EagerAttention)


def _eager_safe(q, k, v) -> bool:
    """A plain eager call on plain tensors, with no dispatch mode (FakeTensor, functionalization,
    debug modes) that must see the op: then the dispatcher layers can be skipped."""
    return type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor and _compat.plain_dispatch()


def cudnn_forward(plan: Plan | None, call: AttentionCall, q, k, v, *, sinks, lengths: Lengths):
    """``(out, lse)`` of a call cuDNN serves: for a plain eager call, straight into the already resolved ``plan``
    (through :class:`_EagerAttention` when gradients are needed); otherwise through the op (traceable, and what
    ``torch.compile`` sees)."""
    if plan is not None and _eager_safe(q, k, v):
        q, k, v = aligned(q, "q"), aligned(k, "k"), aligned(v, "v")
        if not call.needs_grad:
            return run_forward(plan, q, k, v, sinks, lengths, call.need_lse)
        return _eager_attention(q, k, v, sinks, plan, call, lengths)
    return torch.ops.cudnn_attention.forward(q, k, v, need_lse=call.need_lse, **op_args(call, lengths, sinks))


def cudnn_backward(grad_out, q, k, v, out, lse, *, call: AttentionCall, lengths: Lengths, grad_lse=None, sinks=None):
    """dQ, dK, dV and dSinks of a call through the backward op (the provider's kernels sit below torch's own autograd
    and call it directly)."""
    return torch.ops.cudnn_attention.backward(grad_out, q, k, v, out, lse, grad_lse, **op_args(call, lengths, sinks))
