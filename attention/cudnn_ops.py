"""The ``cudnn_attention::forward`` / ``cudnn_attention::backward`` custom ops.

Defined with the low-level ``torch.library.Library`` API (the decorator form costs about 40 us
more per call), with fake kernels that allocate through the same helpers as the real ones and
an autograd formula, so the ops work under ``torch.compile(fullgraph=True)`` and CUDA-graph
capture. Nothing here reads a device value back to the host.

Sinks: the forward folds ``exp(sink_h)`` into cuDNN's softmax denominator, so its LSE includes the
sink. The ordinary cuDNN backward fed that LSE recomputes the right probabilities for dQ/dK/dV, and
``dSink_h = -sum_rows exp(sink_h - lse_row) * rowsum(dO * O)_row``.
"""

from __future__ import annotations

import logging

import torch

from .cudnn_graphs import GraphRejected, GraphSpec, execute, frontend_unavailable_reason, graph_for_call
from .layouts import MIN_SEQ_BUCKET, allocate_backward_outputs, allocate_forward_outputs, like_layout_strides, packed_bounds, shape_bucket, thd_descriptor_strides
from .policy import count_cudnn

__all__ = ["cudnn_forward", "fold_sinks", "resolve_cudnn"]

_logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------


def _geometry(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv):
    """(batch, seq_q, seq_kv, q/k/v descriptor strides, o strides) for either layout."""
    if cu_seqlens_q is None:
        B, H, S_q, _ = q.shape
        o_strides = like_layout_strides((B, H, S_q, v.shape[-1]), q)
        return B, S_q, k.shape[2], q.stride(), k.stride(), v.stride(), o_strides
    H, D_v = q.shape[1], v.shape[-1]
    documents = cu_seqlens_q.numel() - 1
    batch, S_q = packed_bounds(documents=documents, max_seqlen=max_seqlen_q, tokens=q.shape[0])
    _, S_kv = packed_bounds(documents=documents, max_seqlen=max_seqlen_kv, tokens=k.shape[0])
    o_strides = (S_q * H * D_v, D_v, H * D_v, 1)
    return batch, S_q, S_kv, thd_descriptor_strides(q, S_q), thd_descriptor_strides(k, S_kv), thd_descriptor_strides(v, S_kv), o_strides


def _spec(direction, q, k, v, *, sinks, padded, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right, need_lse, deterministic):
    packed = cu_seqlens_q is not None
    batch, S_q, S_kv, q_s, k_s, v_s, o_s = _geometry(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv)
    grad_strides = ()
    total_q = total_kv = 0
    if direction == "backward":
        if packed:
            H, H_kv, D, D_v = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
            grad_strides = ((S_q * H * D, D, H * D, 1), (S_kv * H_kv * D, D, H_kv * D, 1), (S_kv * H_kv * D_v, D_v, H_kv * D_v, 1))
            total_q, total_kv = shape_bucket(q.shape[0], MIN_SEQ_BUCKET), shape_bucket(k.shape[0], MIN_SEQ_BUCKET)
        else:
            grad_strides = tuple(like_layout_strides(tuple(t.shape), t) for t in (q, k, v))
    return GraphSpec(
        direction, q.device.index, q.dtype, batch, q.shape[1], k.shape[1],
        S_q, S_kv, q.shape[-1], v.shape[-1], tuple(q_s), tuple(k_s), tuple(v_s), tuple(o_s), grad_strides,
        float(scale), left, right, bottom_right, sinks and direction == "forward", padded, packed,
        need_lse or direction == "backward", total_q, total_kv, deterministic and direction == "backward",
    )  # fmt: skip


def _graph_for(direction, q, k, v, sinks, padded, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right, need_lse,
               deterministic):  # fmt: skip
    """The compiled graph serving this call (raises :class:`GraphRejected`). Positional on purpose:
    it runs on every call, and its signature lookup is the whole steady-state cost."""
    signature = (
        direction, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.get_device(),
        None if cu_seqlens_q is None else cu_seqlens_q.shape[0], max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right,
        sinks, padded, need_lse, deterministic,
    )  # fmt: skip
    return graph_for_call(
        signature,
        lambda: _spec(
            direction, q, k, v, sinks=sinks, padded=padded, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv, scale=scale, left=left, right=right, bottom_right=bottom_right, need_lse=need_lse,
            deterministic=deterministic,
        ),
    )  # fmt: skip


def resolve_cudnn(q, k, v, *, has_sinks, padded, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right, need_lse,
                  needs_grad):  # fmt: skip
    """``(forward plan, None)`` when cuDNN serves this call, ``(None, reason)`` when it cannot
    (a plan is what :func:`_forward_plan` returns).

    One predicate for both directions: when gradients will be needed the backward graph must
    build too, so a call never starts on cuDNN and finishes elsewhere. Under ``torch.compile``
    graphs cannot be built while tracing, so the answer is ``(None, None)`` and a configuration
    cuDNN rejects raises from inside the op, with the reason, at run time.
    """
    if not q.is_cuda:
        return None, f"{q.device.type} tensors"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return None, f"{q.dtype} inputs (cuDNN attention runs float16/bfloat16)"
    if torch.compiler.is_compiling():
        return None, None
    unavailable = frontend_unavailable_reason()
    if unavailable is not None:
        return None, unavailable
    try:
        plan = _forward_plan(q, k, v, has_sinks, padded, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right, need_lse)
        if needs_grad:
            _graph_for("backward", q, k, v, has_sinks, padded, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right,
                       True, torch.are_deterministic_algorithms_enabled())  # fmt: skip
    except GraphRejected as rejected:
        return None, str(rejected)
    return plan, None


def _forward_plan(q, k, v, has_sinks, padded, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right, need_lse):
    """``(forward graph, folds_sinks)`` (raises :class:`GraphRejected`).

    cuDNN's sink engine declines some shapes (9.19: a single query row, ``s_q == 1``, which is every
    decode step of gpt-oss). The sink-less graph serves those exactly: with its LSE, the sink
    forward is one elementwise fold (:func:`fold_sinks`), and the backward needs nothing else.
    """
    try:
        graph = _graph_for("forward", q, k, v, has_sinks, padded, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right,
                           need_lse, False)  # fmt: skip
        return graph, False
    except GraphRejected:
        if not has_sinks:
            raise
    graph = _graph_for("forward", q, k, v, False, padded, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, left, right, bottom_right, True,
                       False)  # fmt: skip
    return graph, True


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Turn a sink-less ``(out, lse)`` into the sink forward's, in place: each sink adds
    ``exp(sink_h)`` to its head's denominator, so ``lse' = logaddexp(lse, sink)`` and
    ``out' = out * exp(lse - lse')``. Rows with no key (``lse = -inf``) stay zero and ``-inf``; a
    NaN sink gives NaN rows, as in torch. ``lse`` is (B, H, S) or (T, H), fp32."""
    sinks_view = sinks.view(1, -1, 1) if lse.dim() == 3 else sinks.view(1, -1)
    no_key = lse == float("-inf")
    folded = torch.logaddexp(lse, sinks_view)
    factor = torch.where(no_key, 0.0, torch.exp(lse - folded))
    out.mul_(factor.unsqueeze(-1))
    lse.copy_(torch.where(no_key, lse, folded))


# ----------------------------------------------------------------------------------------------
# Per-call operands
# ----------------------------------------------------------------------------------------------


def _aligned(t: torch.Tensor, name: str) -> torch.Tensor:
    # cuDNN descriptors need a 16-byte aligned base; equal strides with an odd offset would fault.
    if t.data_ptr() % 16:
        _logger.warning("cudnn_attention: copying %s to a 16-byte aligned buffer (slow path)", name)
        return torch.empty_like(t).copy_(t)
    return t


def _length_operands(graph, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv) -> list:
    """Per-batch lengths and ragged offsets, computed on the device (no host reads)."""
    if cu_seqlens_q is None:
        if seqlens_q is None:
            return []
        return [_aligned(seqlens_q, "seqlens_q").view(-1, 1, 1, 1), _aligned(seqlens_kv, "seqlens_kv").view(-1, 1, 1, 1)]
    extra = graph.batch + 1 - cu_seqlens_q.numel()
    if extra:
        # Bucketed document count: trailing empty documents (zero length, offsets at the end).
        cu_seqlens_q = torch.cat([cu_seqlens_q, cu_seqlens_q[-1:].expand(extra)])
        cu_seqlens_kv = torch.cat([cu_seqlens_kv, cu_seqlens_kv[-1:].expand(extra)])
    len_q, len_kv = (cu[1:] - cu[:-1] for cu in (cu_seqlens_q, cu_seqlens_kv))
    # A document with queries but no key: no query rows (zero output), as in effective_lengths.
    lengths = [torch.where(len_kv > 0, len_q, 0).to(torch.int32).view(-1, 1, 1, 1), len_kv.to(torch.int32).view(-1, 1, 1, 1)]
    wide = {"q": cu_seqlens_q.to(torch.int64), "kv": cu_seqlens_kv.to(torch.int64)}
    return lengths + [(wide[side] * token_stride).view(-1, 1, 1, 1) for side, token_stride in graph.ragged_columns]


def _sink_gradient(grad_out, out, lse, sinks):
    """dSink from the sink-inclusive LSE; rows with ``lse = -inf`` (padding) contribute nothing."""
    row_dot = (grad_out.float() * out.float()).sum(-1)  # (B, H, S) or (T, H)
    sinks_view = sinks.view(1, -1, 1) if lse.dim() == 3 else sinks.view(1, -1)
    weight = torch.exp(sinks_view - lse).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    reduce_dims = (0, 2) if lse.dim() == 3 else (0,)
    return -(weight * row_dot).sum(reduce_dims)


# ----------------------------------------------------------------------------------------------
# Real kernels
# ----------------------------------------------------------------------------------------------


def _run_forward(plan, q, k, v, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, need_lse):
    graph, folds_sinks = plan
    graph_sinks = None if folds_sinks else sinks
    out, lse = allocate_forward_outputs(
        q, v, packed=cu_seqlens_q is not None, padded=seqlens_q is not None, need_lse=need_lse or folds_sinks, out_strides=graph.out_strides
    )
    operands = [q, k, v, out]
    if lse is not None:
        operands.append(lse.unsqueeze(-1))
    if graph_sinks is not None:
        operands.append(_aligned(graph_sinks, "sinks").view(1, -1, 1, 1))
    operands += _length_operands(graph, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv)
    execute(graph, operands, q.device.index)
    if folds_sinks:
        fold_sinks(out, lse, sinks)
        if not need_lse:
            lse = None
    if seqlens_q is not None:
        valid_B1S1 = _valid_rows(seqlens_q, q.shape[2])
        out.mul_(valid_B1S1)
        if lse is not None:
            lse.masked_fill_(~valid_B1S1[..., 0], float("-inf"))
    count_cudnn("forward")
    return out, lse


def _valid_rows(seqlens_q, s_q: int) -> torch.Tensor:
    """(B, 1, S_q, 1) bool: query rows inside their sequence. cuDNN 9.19 writes rows of a sequence
    whose query length is 0 when S_q is small (seen at S_q = 1), so padded outputs, incoming
    gradients and dQ are masked with it rather than trusted to the kernel."""
    return (torch.arange(s_q, device=seqlens_q.device) < seqlens_q.view(-1, 1)).view(-1, 1, s_q, 1)


def _forward_cuda(q, k, v, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale, window_left,
                  window_right, bottom_right, need_lse):  # fmt: skip
    q, k, v = _aligned(q, "q"), _aligned(k, "k"), _aligned(v, "v")
    plan = _forward_plan(q, k, v, sinks is not None, seqlens_q is not None, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, window_left,
                         window_right, bottom_right, need_lse)  # fmt: skip
    out, lse = _run_forward(plan, q, k, v, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, need_lse)
    return out, lse if lse is not None else _no_lse(q)


def _no_lse(q):
    # An op must return a tensor; the fake kernel returns the same empty placeholder.
    return torch.empty((0,), dtype=torch.float32, device=q.device)


def _backward_cuda(grad_out, q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                   scale, window_left, window_right, bottom_right, deterministic):  # fmt: skip
    q, k, v, out = _aligned(q, "q"), _aligned(k, "k"), _aligned(v, "v"), _aligned(out, "out")
    valid_B1S1 = None if seqlens_q is None else _valid_rows(seqlens_q, q.shape[2])
    if valid_B1S1 is not None:
        grad_out = grad_out * valid_B1S1  # padded rows' outputs are constant zero: no gradient flows from them
    if grad_out.stride() != out.stride() or grad_out.dtype != out.dtype or grad_out.data_ptr() % 16:
        # cuDNN reads dO with O's descriptor.
        grad_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device).copy_(grad_out)
    graph = _graph_for("backward", q, k, v, sinks is not None, seqlens_q is not None, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale,
                       window_left, window_right, bottom_right, True, deterministic)  # fmt: skip
    dq, dk, dv, dsinks = allocate_backward_outputs(q, k, v, sinks, packed=cu_seqlens_q is not None, padded=seqlens_q is not None)
    operands = [q, k, v, out, grad_out, lse.unsqueeze(-1), dq, dk, dv]
    operands += _length_operands(graph, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv)
    execute(graph, operands, q.device.index)
    if valid_B1S1 is not None:
        dq.mul_(valid_B1S1)
    if sinks is not None:
        dsinks.copy_(_sink_gradient(grad_out, out, lse, sinks))
    count_cudnn("backward")
    return dq, dk, dv, dsinks


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

_lib = torch.library.Library("cudnn_attention", "DEF")
_lib.define(
    "forward(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? seqlens_q, Tensor? seqlens_kv, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_kv, int max_seqlen_q, int max_seqlen_kv, float scale, int window_left, int window_right, "
    "bool bottom_right, bool need_lse) -> (Tensor, Tensor)"
)
_lib.define(
    "backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? sinks, Tensor? seqlens_q, "
    "Tensor? seqlens_kv, Tensor? cu_seqlens_q, Tensor? cu_seqlens_kv, int max_seqlen_q, int max_seqlen_kv, float scale, "
    "int window_left, int window_right, bool bottom_right, bool deterministic) -> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.impl("forward", _forward_cuda, "CUDA")
_lib.impl("backward", _backward_cuda, "CUDA")


@torch.library.register_fake("cudnn_attention::forward", lib=_lib)
def _forward_fake(q, k, v, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale, window_left,
                  window_right, bottom_right, need_lse):  # fmt: skip
    out, lse = allocate_forward_outputs(q, v, packed=cu_seqlens_q is not None, padded=seqlens_q is not None, need_lse=need_lse)
    return out, lse if lse is not None else _no_lse(q)


@torch.library.register_fake("cudnn_attention::backward", lib=_lib)
def _backward_fake(grad_out, q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                   scale, window_left, window_right, bottom_right, deterministic):  # fmt: skip
    return allocate_backward_outputs(q, k, v, sinks, packed=cu_seqlens_q is not None, padded=seqlens_q is not None)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, seqlens_q, seqlens_kv, cu_q, cu_kv, max_q, max_kv, scale, left, right, bottom_right, _need_lse = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, cu_q, cu_kv)
    ctx.options = (max_q, max_kv, scale, left, right, bottom_right)
    # The returned LSE is an output for inspection; cuDNN's backward consumes it but has no dLSE.
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, grad_out, _grad_lse):
    if grad_out is None:
        return (None,) * 15
    q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, cu_q, cu_kv = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.cudnn_attention.backward(
        grad_out, q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, cu_q, cu_kv, *ctx.options, torch.are_deterministic_algorithms_enabled()
    )
    return (dq, dk, dv, dsinks if sinks is not None else None) + (None,) * 11


torch.library.register_autograd("cudnn_attention::forward", _backward_formula, setup_context=_setup_context, lib=_lib)


def cudnn_forward(plan, q, k, v, *, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale, mask,
                  need_lse, needs_grad):  # fmt: skip
    """Run the forward: through the op (differentiable, traceable), or, for a plain eager call
    that needs no gradient, straight into the already resolved ``plan`` (the dispatcher and
    autograd layers cost more host time than the kernel launch itself)."""
    if plan is not None and not needs_grad and not torch._C._len_torch_dispatch_stack():
        q, k, v = _aligned(q, "q"), _aligned(k, "k"), _aligned(v, "v")
        return _run_forward(plan, q, k, v, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, need_lse)
    return torch.ops.cudnn_attention.forward(
        q, k, v, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale,
        mask.left, mask.right, mask.bottom_right, need_lse,
    )  # fmt: skip
