"""The ``cudnn_attention::forward`` / ``cudnn_attention::backward`` custom ops.

Defined with the low-level ``torch.library.Library`` API (the decorator form costs about 40 us
more per call), with fake kernels that allocate through the same helpers as the real ones and
an autograd formula, so the ops work under ``torch.compile(fullgraph=True)`` and CUDA-graph
capture. Nothing here reads a device value back to the host.

Sinks: the forward folds ``exp(sink_h)`` into the softmax denominator, with cuDNN's sink engine or
with the sink-less kernel plus :func:`~cudnn_attention.fused_sinks.fold_sinks` (``SINK_FORWARD``),
so the LSE includes the sink. The ordinary cuDNN backward fed that LSE recomputes
the right probabilities for dQ/dK/dV, and ``dSink_h = -sum_rows exp(sink_h - lse_row) * rowsum(dO * O)_row``.

The returned LSE is differentiable (FlashAttention 4 does the same; torchtitan trains gpt-oss sinks as
``out * sigmoid(lse - sink)`` over a sink-less kernel). cuDNN's backward graph takes no dLSE, so its share
comes from one more launch of the same graph (see :func:`_lse_gradient_operands`), only when a loss uses
the LSE: an unused output reaches the backward as None (``set_materialize_grads(False)``). Under
``torch.compile`` an LSE returned out of the compiled region and left unused reaches it as zeros (AOT
autograd materializes its outputs' gradients): that launch then runs and adds zero.

A plain eager call skips the dispatcher (:class:`_EagerAttention`); ``torch.compile``, dispatch
modes and tensor subclasses see the ops.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from . import _compat, tensor_memo, validation
from .call import NO_LENGTHS, AttentionCall, Lengths
from .cudnn_graphs import CompiledGraph, GraphRejected, GraphSpec, execute, frontend_unavailable_reason, graph_for_call, memoize, memoized
from .fused_sinks import fold_sinks, sink_gradient
from .layouts import MIN_SEQ_BUCKET, allocate_backward_outputs, allocate_forward_outputs, like_layout_strides, packed_bounds, shape_bucket, thd_descriptor_strides
from .masking import MaskSpec
from .policy import count_cudnn, note_fallback
from .reference import exact_attention

__all__ = ["Plan", "SINK_FORWARD", "cudnn_forward", "fold_sinks", "resolve_cudnn"]

_logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------

# How the sink forward runs: "engine" (cuDNN's sink engine), "fold" (the sink-less kernel, then one fused
# pass that folds the sinks into its output and LSE, see fused_sinks.fold_sinks), or "auto", the default:
# the fold for packed calls, the engine for the rest. cuDNN 9.19's fast forward engine (eng2) does not
# build a ragged graph with sinks, so a packed sink graph runs on eng1: on an H200 at the packed gpt-oss
# shape 0.65-0.73 ms against 0.338 without sinks (window 128) and 3.16-3.18 ms against 0.833 (causal),
# while the fold takes 1.02-1.14x the sink-less forward. Dense sink graphs take 0.92-1.05x the sink-less
# forward, and the engine rounds the output to bf16 once where the fold rounds twice (max abs
# error 8.2e-3 against 1.5e-2; transformers' flex_attention sinks do the same fold, with a bf16 LSE).
# Rounding once in the fold would need the sink-less kernel to write O in float32: 9.19 builds that graph
# but writes wrong values (max abs error 4e37 packed, 5.1 dense), so it is not used. The engine declines
# single-query rows (s_q = 1), which take the fold whatever the setting.
SINK_FORWARD = os.environ.get("CUDNN_ATTENTION_SINK_FORWARD", "auto")
_SINK_FORWARD_CHOICES = ("auto", "engine", "fold")


class Plan(NamedTuple):
    """The graphs that serve one call, resolved once and handed to the kernels."""

    forward: CompiledGraph
    backward: CompiledGraph | None  # built up front when gradients will be needed
    folds_sinks: bool  # the forward graph is sink-less and the sinks are folded in afterwards
    deterministic: bool  # what the backward graph was resolved for

    @property
    def specs(self) -> tuple:
        return (self.forward.spec,) if self.backward is None else (self.forward.spec, self.backward.spec)


def _geometry(q, k, v, call: AttentionCall):
    """(batch, seq_q, seq_kv, q/k/v descriptor strides, o strides) for either layout."""
    if not call.packed:
        B, H, S_q, _ = q.shape
        o_strides = like_layout_strides((B, H, S_q, v.shape[-1]), q)
        return B, S_q, k.shape[2], q.stride(), k.stride(), v.stride(), o_strides
    H, D_v = q.shape[1], v.shape[-1]
    documents = call.documents
    batch, S_q = packed_bounds(documents=documents, max_seqlen=call.max_seqlen_q, tokens=q.shape[0])
    _, S_kv = packed_bounds(documents=documents, max_seqlen=call.max_seqlen_kv, tokens=k.shape[0])
    o_strides = (S_q * H * D_v, D_v, H * D_v, 1)
    return batch, S_q, S_kv, thd_descriptor_strides(q, S_q), thd_descriptor_strides(k, S_kv), thd_descriptor_strides(v, S_kv), o_strides
def _spec(direction, q, k, v, call: AttentionCall, deterministic: bool) -> GraphSpec:
    batch, S_q, S_kv, q_s, k_s, v_s, o_s = _geometry(q, k, v, call)
    grad_strides = ()
    total_q = total_kv = 0
    backward = direction == "backward"
    if backward:
        if call.packed:
            H, H_kv, D, D_v = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
            grad_strides = ((S_q * H * D, D, H * D, 1), (S_kv * H_kv * D, D, H_kv * D, 1), (S_kv * H_kv * D_v, D_v, H_kv * D_v, 1))
            total_q, total_kv = shape_bucket(q.shape[0], MIN_SEQ_BUCKET), shape_bucket(k.shape[0], MIN_SEQ_BUCKET)
        else:
            grad_strides = tuple(like_layout_strides(tuple(t.shape), t) for t in (q, k, v))
    mask = call.mask
    return GraphSpec(
        direction, q.device.index, q.dtype, batch, q.shape[1], k.shape[1],
        S_q, S_kv, q.shape[-1], v.shape[-1], tuple(q_s), tuple(k_s), tuple(v_s), tuple(o_s), grad_strides,
        float(call.scale), mask.left, mask.right, mask.bottom_right, call.has_sinks and not backward, call.padded, call.packed,
        call.need_lse or backward, total_q, total_kv, deterministic and backward,
    )  # fmt: skip


def _tensor_geometry(q, k, v) -> tuple:
    """What of q/k/v a graph or plan depends on besides the call value: a handful of attribute reads."""
    return q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.get_device()


def _graph_for(direction: str, q, k, v, call: AttentionCall, deterministic: bool):
    """The compiled graph serving this call (raises :class:`GraphRejected`). The key is the call
    value plus the tensors' geometry, the whole steady-state cost."""
    signature = (direction, call, _tensor_geometry(q, k, v), deterministic)
    return graph_for_call(signature, lambda: _spec(direction, q, k, v, call, deterministic))


def resolve_cudnn(q, k, v, call: AttentionCall) -> tuple[Plan | None, str | None]:
    """``(plan, None)`` when cuDNN serves this call, ``(None, reason)`` when it cannot.

    One predicate for both directions: when gradients will be needed the backward graph must
    build too, so a call never starts on cuDNN and finishes elsewhere. float16/bfloat16 meta tensors answer
    ``(None, None)``: the op serves them with its fake kernel. Under ``torch.compile``
    graphs cannot be built while tracing, so the answer is ``(None, None)`` and a configuration
    cuDNN rejects takes the exact path inside the op at run time (:func:`_exact_forward`), counted and warned
    about there. A plan is kept for the
    call value and the tensors' geometry (see :func:`cudnn_attention.cudnn_graphs.memoize`).
    """
    if q.device.type == "meta" and q.dtype in (torch.float16, torch.bfloat16):
        # Nothing is computed on meta tensors: the op's fake kernel gives the outputs a GPU call would, and FLOP counters
        # (Lightning's measure_flops builds its model on meta) count the op by its masks, not the exact path's full products.
        return None, None
    if not q.is_cuda:
        return None, f"{q.device.type} tensors"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return None, f"{q.dtype} inputs (cuDNN attention runs float16/bfloat16)"
    if torch.compiler.is_compiling():
        return None, None
    unavailable = frontend_unavailable_reason()
    if unavailable is not None:
        return None, unavailable
    deterministic = torch.are_deterministic_algorithms_enabled()
    signature = ("plan", call, _tensor_geometry(q, k, v), deterministic, SINK_FORWARD)
    plan = memoized(signature)
    if plan is None:
        try:
            plan = _plan(q, k, v, call, deterministic)
        except GraphRejected as rejected:
            return None, str(rejected)
        memoize(signature, plan, plan.specs)
    return plan, None


def _asks_sink_engine(call: AttentionCall) -> bool:
    """Whether a sink forward tries cuDNN's sink engine before the fold (see ``SINK_FORWARD``)."""
    if SINK_FORWARD not in _SINK_FORWARD_CHOICES:
        raise ValueError(f"CUDNN_ATTENTION_SINK_FORWARD={SINK_FORWARD!r}: expected one of {', '.join(_SINK_FORWARD_CHOICES)}")
    return SINK_FORWARD == "engine" or (SINK_FORWARD == "auto" and not call.packed)


def _plan(q, k, v, call: AttentionCall, deterministic: bool) -> Plan:
    """Raises :class:`GraphRejected`.

    Sinks: cuDNN's sink engine (dense calls, by default), which declines some shapes (9.19: a single
    query row, ``s_q == 1``, every gpt-oss decode step), or the sink-less graph plus :func:`fold_sinks`
    (packed calls, by default), which serves those too. The backward never needs the sinks in its graph.
    """
    forward = None
    folds = call.has_sinks
    if call.has_sinks and _asks_sink_engine(call):
        try:
            forward, folds = _graph_for("forward", q, k, v, call, False), False
        except GraphRejected:
            pass
    if forward is None:
        # The fold needs the sink-less LSE; the graph key drops the sinks flag and forces the LSE.
        forward = _graph_for("forward", q, k, v, call._replace(has_sinks=False, need_lse=True) if folds else call, False)
    backward = _graph_for("backward", q, k, v, call, deterministic) if call.needs_grad else None
    return Plan(forward, backward, folds, deterministic)


def _packed_absent_rows(cu_seqlens_q, cu_seqlens_kv, tokens: int) -> torch.Tensor:
    """(T, 1) bool: packed query tokens in no document (past ``cu_seqlens_q[-1]``) or in a document with no key."""
    document_T = torch.searchsorted(cu_seqlens_q, torch.arange(tokens, device=cu_seqlens_q.device, dtype=cu_seqlens_q.dtype), right=True) - 1
    has_keys = torch.cat([cu_seqlens_kv[1:] > cu_seqlens_kv[:-1], cu_seqlens_kv.new_zeros(1, dtype=torch.bool)])
    return ~has_keys[document_T].unsqueeze(-1)


# ----------------------------------------------------------------------------------------------
# Per-call operands
# ----------------------------------------------------------------------------------------------


def _aligned(t: torch.Tensor, name: str) -> torch.Tensor:
    # cuDNN descriptors need a 16-byte aligned base; equal strides with an odd offset would fault.
    if t.data_ptr() % 16:
        _logger.warning("cudnn_attention: copying %s to a 16-byte aligned buffer (slow path)", name)
        return torch.empty_like(t).copy_(t)
    return t


def _length_operands(graph, lengths: Lengths) -> list:
    """Per-batch lengths and ragged offsets, computed on the device (no host reads). Packed: about
    ten small kernels, so they are kept on ``cu_seqlens_q`` (see :mod:`~cudnn_attention.tensor_memo`):
    every layer of a forward and every backward of the same batch reuses them."""
    cu_seqlens_q, cu_seqlens_kv = lengths.cu_seqlens_q, lengths.cu_seqlens_kv
    if cu_seqlens_q is None:
        if lengths.seqlens_q is None:
            return []
        return [_aligned(lengths.seqlens_q, "seqlens_q"), _aligned(lengths.seqlens_kv, "seqlens_kv")]
    return _memoized(cu_seqlens_q, cu_seqlens_kv, ("ragged operands", graph.batch, graph.ragged_columns),
                     lambda: _ragged_operands(graph, cu_seqlens_q, cu_seqlens_kv))  # fmt: skip


def _memoized(cu_seqlens_q, cu_seqlens_kv, key: tuple, compute):
    """``compute()``, kept on the prefix sums for this stream; not while capturing a CUDA graph,
    whose kernels must read tensors from its own memory pool."""
    if cu_seqlens_q.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return compute()
        key += (_compat.current_raw_stream(cu_seqlens_q.get_device()),)
    value = tensor_memo.recall(cu_seqlens_q, key, cu_seqlens_kv)
    if value is None:
        value = compute()
        tensor_memo.remember(cu_seqlens_q, key, value, cu_seqlens_kv)
    return value


def _ragged_operands(graph, cu_seqlens_q, cu_seqlens_kv) -> list:
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


def _padding_rows(seqlens_q, s_q: int) -> torch.Tensor:
    """(B, 1, S_q, 1) bool: query rows past their sequence's length. cuDNN 9.19 writes rows of a
    sequence whose query length is 0 when S_q is small (seen at S_q = 1), and leaves other padded
    rows unwritten, so padded outputs, incoming gradients and dQ are masked with it rather than
    trusted to the kernel (``masked_fill``, not a product: unwritten memory may hold NaN)."""
    return (torch.arange(s_q, device=seqlens_q.device) >= seqlens_q.view(-1, 1)).view(-1, 1, s_q, 1)


# ----------------------------------------------------------------------------------------------
# Real kernels
# ----------------------------------------------------------------------------------------------


def _writes_every_row(q, k, lengths: Lengths) -> bool:
    """Whether the kernels write every packed row of O, the LSE, dQ, dK and dV, so none needs a zero
    fill first: every token lies in a document (:func:`~cudnn_attention.validation.every_token_covered`,
    as in every transformers batch) and q and kv share one prefix-sum tensor, so every document with
    queries has keys and every key is seen by its own query (every mask keeps the diagonal)."""
    cu_seqlens_q = lengths.cu_seqlens_q
    return (
        cu_seqlens_q is lengths.cu_seqlens_kv and q.shape[0] == k.shape[0]
        and validation.every_token_covered(cu_seqlens_q, cu_seqlens_q, q.shape[0], k.shape[0])
    )  # fmt: skip


def _run_forward(plan: Plan, q, k, v, sinks, lengths: Lengths, need_lse: bool):
    graph, folds = plan.forward, plan.folds_sinks
    seqlens_q, cu_seqlens_q, cu_seqlens_kv = lengths.seqlens_q, lengths.cu_seqlens_q, lengths.cu_seqlens_kv
    padded, packed = seqlens_q is not None, cu_seqlens_q is not None
    every_row = packed and _writes_every_row(q, k, lengths)
    # The fold writes every row, absent ones as zero and -inf: a packed out and LSE need no fill then.
    out, lse = allocate_forward_outputs(
        q, v, packed=packed, need_lse=need_lse or folds, out_strides=graph.out_strides, zero_tails=not (folds or every_row)
    )
    # Operands are read for their addresses alone (see cudnn_graphs.execute): no (B, H, S, 1) views of the LSE or sinks.
    operands = [q, k, v, out]
    if lse is not None:
        operands.append(lse)
    if sinks is not None and not folds:
        operands.append(_aligned(sinks, "sinks"))
    operands += _length_operands(graph, lengths)
    execute(graph, operands, q.device.index)
    invalid_B1S1 = _padding_rows(seqlens_q, q.shape[2]) if padded else None
    if folds:
        absent = None
        if padded:
            absent = invalid_B1S1[..., 0]
        elif packed and not every_row:
            tokens = q.shape[0]
            absent = _memoized(cu_seqlens_q, cu_seqlens_kv, ("absent rows", tokens), lambda: _packed_absent_rows(cu_seqlens_q, cu_seqlens_kv, tokens))
        fold_sinks(out, lse, sinks, absent)
        if not need_lse:
            lse = None
    elif padded:
        out.masked_fill_(invalid_B1S1, 0)
        if lse is not None:
            lse.masked_fill_(invalid_B1S1[..., 0], float("-inf"))
    count_cudnn("forward")
    return out, lse


def _run_backward(graph, grad_out, q, k, v, out, lse, sinks, lengths: Lengths, grad_lse=None):
    """``(dq, dk, dv, dsinks)``; ``dsinks`` is None without sinks. q/k/v/out are 16-byte aligned (the
    op's backward aligns what it was handed; the eager path saved the aligned ones its forward ran on).

    ``grad_out`` or ``grad_lse`` may be None (the loss did not use that output), not both. The output's
    gradient is one launch of ``graph``; the LSE's is one more launch of the same graph on stand-in
    operands (:func:`_lse_gradient_operands`), whose dQ and dK are exactly the LSE's share."""
    invalid_B1S1 = None if lengths.seqlens_q is None else _padding_rows(lengths.seqlens_q, q.shape[2])
    packed = lengths.cu_seqlens_q is not None
    zero_tails = not (packed and _writes_every_row(q, k, lengths))
    length_operands = _length_operands(graph, lengths)
    dq = dk = dv = dsinks = None
    if grad_out is not None:
        if invalid_B1S1 is not None:
            grad_out = grad_out.masked_fill(invalid_B1S1, 0)  # padded rows' outputs are constant zero: no gradient flows from them
        if grad_out.stride() != out.stride() or grad_out.dtype != out.dtype or grad_out.data_ptr() % 16:
            # cuDNN reads dO with O's descriptor.
            grad_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device).copy_(grad_out)
        dq, dk, dv = allocate_backward_outputs(
            q, k, v, packed=packed, padded=invalid_B1S1 is not None, grad_strides=graph.grad_strides, zero_tails=zero_tails
        )
        execute(graph, [q, k, v, out, grad_out, lse, dq, dk, dv, *length_operands], q.device.index)
        if sinks is not None:
            dsinks = sink_gradient(grad_out, out, lse, sinks)
    if grad_lse is not None:
        dlse = _masked_lse_gradient(grad_lse, lse)
        v_zero, o_unit, do_lse = _lse_gradient_operands(dlse, out, v)
        lse_dq, lse_dk, lse_dv = allocate_backward_outputs(
            q, k, v, packed=packed, padded=invalid_B1S1 is not None, grad_strides=graph.grad_strides, zero_tails=zero_tails
        )
        execute(graph, [q, k, v_zero, o_unit, do_lse, lse, lse_dq, lse_dk, lse_dv, *length_operands], q.device.index)
        if dq is None:
            # This launch's dV' = P^T dO' belongs to no gradient (the LSE does not depend on V): its buffer becomes dV's zeros.
            dq, dk, dv = lse_dq, lse_dk, lse_dv.zero_()
        else:
            dq.add_(lse_dq)
            dk.add_(lse_dk)
        if sinks is not None:
            lse_dsinks = _lse_sink_gradient(dlse, lse, sinks)
            dsinks = lse_dsinks if dsinks is None else dsinks + lse_dsinks
    if invalid_B1S1 is not None:
        dq.masked_fill_(invalid_B1S1, 0)
    count_cudnn("backward")
    return dq, dk, dv, dsinks


def _masked_lse_gradient(grad_lse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """dLSE in float32, zero on rows with lse = -inf (padding, capacity tails, documents or rows without keys):
    they have no softmax to differentiate, so whatever gradient reached them (NaN included) stops here, before it
    becomes an operand. ``grad_lse`` may have any strides (the gradient of ``lse.sum()`` is an expanded scalar)."""
    return grad_lse.float().masked_fill(lse == float("-inf"), 0.0)


# The stand-in O' is 2**e per row with e in this range: a normal float16 (and bfloat16) value, exact in either.
_UNIT_EXPONENTS = (-14, 15)


def _lse_gradient_operands(dlse: torch.Tensor, out: torch.Tensor, v: torch.Tensor):
    """``(V', O', dO')``: operands for a launch of the backward graph whose dQ and dK are the LSE's share.

    With P the (sink-inclusive) probabilities the graph recomputes from the LSE, a loss's gradient of the
    scores is ``dS = P * (dP - D + dLSE)``, ``dP = dO V^T`` and ``D = rowsum(dO * O)``, which cuDNN computes
    itself from the O and dO it is handed (O serves nothing else). ``V' = 0`` makes ``dP' = 0`` and
    ``rowsum(dO' * O') = -dLSE`` makes ``D' = -dLSE``, so that launch's ``dS' = P * dLSE`` and its dQ' and dK'
    (``scale * dS' K``, ``scale * dS'^T Q``) are the LSE's share; its dV' (``P^T dO'``) is no gradient.

    dLSE (float32) is carried in the input dtype without rounding it to 8 or 11 bits: O' holds ``2**e`` and dO'
    ``-dLSE / 2**e`` split as ``hi + lo`` in its first two head-dim columns (``hi`` the rounded value, ``lo``
    the rounded rest), so cuDNN's float32 ``D' = 2**e * (hi + lo)`` is -dLSE to about 17 significant bits in
    bfloat16 and 23 in float16. The per-row power of two ``2**e`` (of dLSE's own magnitude, within float16's
    normal range) keeps ``hi`` and ``lo`` inside float16's narrow range, as a mean over many rows needs (dLSE
    of 1e-6 and less). float16 still bounds it: 23 bits for |dLSE| from 1e-5 to 2e9, then fewer as ``lo``
    and below 4e-9 ``hi`` leave its normal range (as a float16 output gradient would; float16 training
    scales its loss), inf beyond 2e9. A value dimension of 1 has no second column: dLSE is rounded once there.
    ``test_lse_grad_emulated.py`` measures all of this.

    Each stand-in has the strides of the operand it replaces (the graph holds the descriptors, a launch passes
    addresses): V' v's, O' and dO' out's (dO is read with O's descriptor). No device value is read on the host.
    """
    dtype = out.dtype
    v_zero = _zeros_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    o_unit = _zeros_strided(out.shape, out.stride(), dtype=dtype, device=out.device)
    do_lse = _zeros_strided(out.shape, out.stride(), dtype=dtype, device=out.device)
    target = -dlse
    _, exponent = torch.frexp(target)  # target = mantissa * 2**exponent, 0.5 <= |mantissa| < 1 (exponent 0 for 0)
    unit = torch.exp2(exponent.clamp(*_UNIT_EXPONENTS).to(torch.float32))
    scaled = target / unit  # exact: a power of two
    hi = scaled.to(dtype)
    o_unit[..., 0] = unit.to(dtype)
    do_lse[..., 0] = hi
    if out.shape[-1] >= 2:
        o_unit[..., 1] = unit.to(dtype)
        do_lse[..., 1] = (scaled - hi.float()).to(dtype)
    return v_zero, o_unit, do_lse


def _zeros_strided(shape, stride, *, dtype, device) -> torch.Tensor:
    """Zeros with exactly these strides, for any strides a caller's operand may have: gaps (q, k and v sliced out
    of one projection) and overlaps (an expanded tensor, stride 0) alike, which ``empty_strided(...).zero_()``
    does not allow for the latter."""
    span = 1 + sum((n - 1) * step for n, step in zip(shape, stride)) if all(n > 0 for n in shape) else 0
    return torch.zeros(span, dtype=dtype, device=device).as_strided(shape, stride)


def _lse_sink_gradient(dlse: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The LSE's share of dSink (H,) float32: the sink is one more logit in the denominator, so ``d lse_row /
    d sink_h = exp(sink_h - lse_row)``. Rows with lse = -inf contribute nothing (their dLSE is zero already, and
    ``exp`` would be inf there). Dense LSE (B, H, S), packed (T, H), as in :func:`sink_gradient`."""
    sinks_view = sinks.view(1, -1, 1) if lse.dim() == 3 else sinks.view(1, -1)
    terms = torch.where(lse == float("-inf"), 0.0, dlse * torch.exp(sinks_view - lse))
    return terms.sum((0, 2) if lse.dim() == 3 else (0,))


def _op_call(sinks, seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, window_left, window_right, bottom_right,
             need_lse, needs_grad) -> AttentionCall:  # fmt: skip
    """The call value, rebuilt from the ops' flat schema (ops take no Python objects)."""
    packed = cu_seqlens_q is not None
    return AttentionCall(
        packed, seqlens_q is not None, cu_seqlens_q.numel() - 1 if packed else 0, max_seqlen_q, max_seqlen_kv, scale,
        MaskSpec(window_left, window_right, bottom_right), sinks is not None, need_lse, needs_grad,
    )  # fmt: skip


def _forward_cuda(q, k, v, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale, window_left,
                  window_right, bottom_right, need_lse):  # fmt: skip
    q, k, v = _aligned(q, "q"), _aligned(k, "k"), _aligned(v, "v")
    call = _op_call(sinks, seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, window_left, window_right, bottom_right,
                    need_lse, False)  # fmt: skip
    lengths = Lengths(seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv)
    try:
        plan = _plan(q, k, v, call, False)
    except GraphRejected as rejected:
        return _exact_forward(call, q, k, v, sinks, lengths, str(rejected))
    out, lse = _run_forward(plan, q, k, v, sinks, lengths, need_lse)
    return out, lse if lse is not None else _empty_float32(q)


# Inside the ops a configuration cuDNN rejects takes the exact path itself: under torch.compile no plan is resolved
# while tracing (resolve_cudnn answers (None, None)), so the op is all the compiled graph has. Counted, warned about
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


def _empty_float32(q):
    # An op must return a tensor where the eager path has None (no LSE asked for, no sinks to differentiate);
    # the fake kernels return the same empty placeholder.
    return torch.empty((0,), dtype=torch.float32, device=q.device)


def _backward_cuda(grad_out, q, k, v, out, lse, grad_lse, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                   max_seqlen_kv, scale, window_left, window_right, bottom_right, deterministic):  # fmt: skip
    call = _op_call(sinks, seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, scale, window_left, window_right, bottom_right,
                    True, True)  # fmt: skip
    # The op saved its inputs as given: the forward ran on aligned copies of any that were not.
    q, k, v, out = _aligned(q, "q"), _aligned(k, "k"), _aligned(v, "v"), _aligned(out, "out")
    lengths = Lengths(seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv)
    try:
        graph = _graph_for("backward", q, k, v, call, deterministic)
    except GraphRejected as rejected:
        return _exact_backward(call, grad_out, grad_lse, q, k, v, sinks, lengths, str(rejected))
    dq, dk, dv, dsinks = _run_backward(graph, grad_out, q, k, v, out, lse, sinks, lengths, grad_lse)
    return dq, dk, dv, dsinks if dsinks is not None else _empty_float32(q)


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
    "backward(Tensor? grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse, Tensor? sinks, Tensor? seqlens_q, "
    "Tensor? seqlens_kv, Tensor? cu_seqlens_q, Tensor? cu_seqlens_kv, int max_seqlen_q, int max_seqlen_kv, float scale, "
    "int window_left, int window_right, bool bottom_right, bool deterministic) -> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.impl("forward", _forward_cuda, "CUDA")
_lib.impl("backward", _backward_cuda, "CUDA")


@torch.library.register_fake("cudnn_attention::forward", lib=_lib)
def _forward_fake(q, k, v, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale, window_left,
                  window_right, bottom_right, need_lse):  # fmt: skip
    out, lse = allocate_forward_outputs(q, v, packed=cu_seqlens_q is not None, need_lse=need_lse)
    return out, lse if lse is not None else _empty_float32(q)


@torch.library.register_fake("cudnn_attention::backward", lib=_lib)
def _backward_fake(grad_out, q, k, v, out, lse, grad_lse, sinks, seqlens_q, seqlens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                   max_seqlen_kv, scale, window_left, window_right, bottom_right, deterministic):  # fmt: skip
    dq, dk, dv = allocate_backward_outputs(q, k, v, packed=cu_seqlens_q is not None, padded=seqlens_q is not None)
    return dq, dk, dv, torch.empty((sinks.shape[0],), dtype=torch.float32, device=q.device) if sinks is not None else _empty_float32(q)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, seqlens_q, seqlens_kv, cu_q, cu_kv, max_q, max_kv, scale, left, right, bottom_right, _need_lse = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, cu_q, cu_kv)
    ctx.options = (max_q, max_kv, scale, left, right, bottom_right)
    # The LSE is differentiable; an output the loss does not use arrives as None, so a loss without the LSE
    # costs nothing more (see _run_backward).
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, grad_out, grad_lse):
    if grad_out is None and grad_lse is None:
        return (None,) * 15
    q, k, v, out, lse, sinks, seqlens_q, seqlens_kv, cu_q, cu_kv = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.cudnn_attention.backward(
        grad_out, q, k, v, out, lse, grad_lse, sinks, seqlens_q, seqlens_kv, cu_q, cu_kv, *ctx.options,
        torch.are_deterministic_algorithms_enabled(),
    )
    return (dq, dk, dv, dsinks if sinks is not None else None) + (None,) * 11


torch.library.register_autograd("cudnn_attention::forward", _backward_formula, setup_context=_setup_context, lib=_lib)


class _EagerAttention(torch.autograd.Function):
    """The eager training call without the dispatcher: the op's autograd wrapper costs about 100 us of
    host time per forward (issue 13), this a few. Same kernels, same saved tensors and the same
    backward as the op; the plan, backward graph included, was resolved before the call. The
    ``forward(ctx, ...)`` form on purpose: with ``setup_context`` every apply binds the signature
    with ``inspect`` (about 60 us); functorch transforms, which need that form, take the op instead.
    The index tensors travel as one ``lengths`` argument: ``apply`` costs per argument."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, call, lengths):
        out, lse = _run_forward(plan, q, k, v, sinks, lengths, True)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *lengths)
        ctx.plan, ctx.call = plan, call
        ctx.set_materialize_grads(False)  # the LSE is differentiable; an unused output's gradient arrives as None
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None, None, None
        q, k, v, out, lse, sinks, *lengths = ctx.saved_tensors
        graph, deterministic = ctx.plan.backward, torch.are_deterministic_algorithms_enabled()
        if ctx.plan.deterministic != deterministic:  # switched between forward and backward (the op path resolves per backward too)
            graph = _graph_for("backward", q, k, v, ctx.call, deterministic)
        dq, dk, dv, dsinks = _run_backward(graph, grad_out, q, k, v, out, lse, sinks, Lengths(*lengths), grad_lse)
        return dq, dk, dv, dsinks, None, None, None


# Function.apply's Python layer (torch <= 2.13) binds signatures and unwraps functorch wrappers, neither needed where
# _eager_safe holds.
_eager_attention = _compat.autograd_apply(_EagerAttention)


def _eager_safe(q, k, v) -> bool:
    """A plain eager call on plain tensors, with no dispatch mode (FakeTensor, functionalization,
    debug modes) that must see the op: then the dispatcher layers can be skipped."""
    return type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor and _compat.plain_dispatch()


def cudnn_forward(plan: Plan | None, call: AttentionCall, q, k, v, *, sinks, lengths: Lengths = NO_LENGTHS):
    """Run the forward: for a plain eager call, straight into the already resolved ``plan``
    (through :class:`_EagerAttention` when gradients are needed); otherwise through the op
    (traceable, and what ``torch.compile`` sees)."""
    if plan is not None and _eager_safe(q, k, v):
        q, k, v = _aligned(q, "q"), _aligned(k, "k"), _aligned(v, "v")
        if not call.needs_grad:
            return _run_forward(plan, q, k, v, sinks, lengths, call.need_lse)
        return _eager_attention(q, k, v, sinks, plan, call, lengths)
    mask = call.mask
    out, lse = torch.ops.cudnn_attention.forward(
        q, k, v, sinks, *lengths, call.max_seqlen_q, call.max_seqlen_kv, call.scale, mask.left, mask.right, mask.bottom_right, call.need_lse
    )
    return out, lse
