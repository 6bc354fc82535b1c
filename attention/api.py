"""Public entry points: :func:`attention` (dense) and :func:`varlen_attention` (packed).

Each call is served by cuDNN when it can be, else by the exact PyTorch path, which is counted in
:func:`cudnn_attention.stats`, warned about once per reason, and refused in strict mode.

A call cuDNN served is remembered by its arguments' key (:func:`cudnn_attention.call.served_key`): the
next call with the same shapes, strides, dtypes, devices and options was validated already and resolves
to the same plan, so it goes straight to the kernels.
"""

from __future__ import annotations

import torch

from . import batch_chunks, cp_state, head_groups, validation
from . import plan as plans
from .call import NO_LENGTHS, Prepared, packed_lengths, padding_lengths
from .call_keys import argument_options, served_key
from .cudnn_graphs import memoize, memoized
from .cudnn_ops import cudnn_forward
from .policy import fallback_in_graph, fallback_outputs, note_fallback
from .prepare import prepare_dense, prepare_packed
from .reference import exact_attention

__all__ = ["attention", "serve", "varlen_attention"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    bottom_right: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    seqlens_q: torch.Tensor | None = None,
    seqlens_kv: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool | None = None,
    validate: bool = False,
):
    """Scaled dot-product attention over dense (B, H, S, D) tensors, on cuDNN when it can serve the call.

    Args:
        q, k, v: (B, H_q, S_q, D), (B, H_kv, S_kv, D), (B, H_kv, S_kv, D_v); any B/H/S stride order
            with the head dim innermost (transposed views of (B, S, H, D) are served without a copy).
            H_q must be a multiple of H_kv (GQA/MQA; K/V are not repeated).
        scale: softmax scale, default ``1 / sqrt(D)``; any finite value (0 gives uniform weights).
        causal: hide future keys (``window_size`` right bound 0).
        bottom_right: anchor the causal/window diagonal at the last query and key (decode with a
            KV cache, S_q < S_kv); per sequence when lengths are given. No effect without a band.
        window_size: ``(left, right)``, FlashAttention's convention: query i sees key j iff
            ``i - left <= j <= i + right``; -1 leaves a side unbounded.
        sinks: (H_q,) learnable logits, any float dtype (gpt-oss): each adds ``exp(sink_h)`` to its
            head's softmax denominator and carries no value. Differentiable.
        seqlens_q, seqlens_kv: (B,) int valid lengths of a right-padded batch, clamped to
            ``[0, S]``. Output rows past a length, and every row of a sequence with no key, are
            zero and get zero gradient; keys past a length are never attended.
        return_lse: also return the log-sum-exp (B, H_q, S_q), sink included, ``-inf`` for padded or
            fully masked rows. float32, except for float64 inputs: those are computed in float64
            throughout on the exact path (sinks of any dtype included, so ``torch.autograd.gradcheck``
            holds), and their LSE is float64 too. Differentiable, through q, k and the sinks (a loss may
            use it, e.g. ``out * sigmoid(lse - sink)``); its ``-inf`` rows pass no gradient on. On cuDNN
            a loss that uses it costs one more launch of the backward kernel; one that does not, nothing.
        deterministic: run this call's backward with cuDNN's deterministic algorithm (True) or its
            fastest one (False); None (the default) follows ``torch.are_deterministic_algorithms_enabled()``
            as it reads when the backward runs. The forward is deterministic either way.
        validate: also check lengths against the shapes on the host. This synchronizes with the
            device, so it is off by default.

    Returns:
        ``out`` (B, H_q, S_q, D_v) in q's dtype and layout, or ``(out, lse)``.

    Raises:
        TypeError, ValueError: bad input, before any kernel runs.
        StrictModeError: in strict mode, when cuDNN cannot serve the call.

    Traceable by ``torch.compile(fullgraph=True)`` on every path: the cuDNN ops, and the exact path, whose
    counting, warning and strict check then run inside the compiled graph each time it runs (see
    :func:`cudnn_attention.policy.fallback_in_graph`; a refused compiled call raises after computing,
    before returning). ``validate=True`` reads lengths on the host, which a full graph cannot.
    """
    if cp_state.active is not None:  # inside context_parallel.over(): q/k/v are this rank's shards (context_parallel.py)
        return cp_state.active.serve("attention", locals())  # locals(): this call's arguments, by name (nothing else is bound yet)
    key = None
    if not validate:
        options = argument_options(
            q,
            k,
            v,
            scale,
            causal,
            bottom_right,
            window_size,
            sinks,
            return_lse,
            (seqlens_q, seqlens_kv),
            (),
            plans.sink_forward(),
            (deterministic,),
        )
        key = None if options is None else served_key(options, q, k, v)
    served = None if key is None else memoized(key)
    if served is not None:
        call, resolved = served
        lengths = padding_lengths(seqlens_q, seqlens_kv, q.shape[0], q.shape[2], k.shape[2], q.device) if call.padded else NO_LENGTHS
        out, lse = serve(Prepared(call, q, k, v, sinks, lengths), plan=resolved)
    else:
        prepared = prepare_dense(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            bottom_right=bottom_right,
            window_size=window_size,
            sinks=sinks,
            seqlens_q=seqlens_q,
            seqlens_kv=seqlens_kv,
            return_lse=return_lse,
            validate=validate,
            key=key,
            deterministic=deterministic,
        )
        out, lse = serve(prepared)
    return (out, lse) if return_lse else out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    scale: float | None = None,
    causal: bool = False,
    bottom_right: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool | None = None,
    validate: bool = False,
):
    """Attention over packed documents: (T, H, D) tensors and int32/int64 prefix sums of lengths.

    Document b holds tokens ``cu_seqlens[b]:cu_seqlens[b + 1]`` of each side; no token attends
    outside its document. ``max_seqlen_*`` (non-negative Python ints) bound the longest document of
    their side: any upper bound, as in FlashAttention (a static one larger than the batch is used as
    its token count T). Tokens past ``cu_seqlens[-1]`` (a capacity tail) get a zero output and zero
    gradient. Options as in :func:`attention`, applied per document (``bottom_right`` aligns each
    document's last query with its last key).

    The prefix sums must start at 0, never decrease, end within T and respect ``max_seqlen_*``.
    ``validate=True`` checks that on the host with an error naming the value; it synchronizes with
    the device, so it is off by default. Without it CPU tensors are checked all the same (no sync
    there), and CUDA ones by a device-side assertion queued ahead of the kernels (see
    :func:`cudnn_attention.validation.check_prefix_sums`): bad offsets stop the process
    loudly instead of reading out of bounds. ``max_seqlen_* = 0`` (every document empty) and
    ``T = 0`` give an empty or zero result.

    Returns:
        ``out`` (T_q, H_q, D_v), or ``(out, lse)`` with ``lse`` (T_q, H_q) float32 (float64 for float64
        inputs), differentiable as in :func:`attention` (``-inf`` on tokens in no document or in a document
        without keys).
    """
    if cp_state.active is not None:  # inside context_parallel.over(): q/k/v are this rank's shards (context_parallel.py)
        return cp_state.active.serve("varlen_attention", locals())
    key = None
    if not validate:
        options = argument_options(
            q,
            k,
            v,
            scale,
            causal,
            bottom_right,
            window_size,
            sinks,
            return_lse,
            (cu_seqlens_q, cu_seqlens_kv),
            (max_seqlen_q, max_seqlen_kv),
            plans.sink_forward(),
            (deterministic,),
        )
        key = None if options is None else served_key(options, q, k, v)
    served = None if key is None else memoized(key)
    if served is not None:  # its q/k/v were token-major already (else they would have been copied, and the call not remembered)
        call, resolved = served
        # The call holds the maxima as validated: clamped to the token counts.
        lengths = packed_lengths(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0])
        lengths.batch.check(call.max_seqlen_q, call.max_seqlen_kv, validate=False, cover_all=False)
        out, lse = serve(Prepared(call, q, k, v, sinks, lengths), plan=resolved)
    else:
        prepared = prepare_packed(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            scale=scale,
            causal=causal,
            bottom_right=bottom_right,
            window_size=window_size,
            sinks=sinks,
            return_lse=return_lse,
            validate=validate,
            key=key,
            deterministic=deterministic,
        )
        out, lse = serve(prepared)
    return (out, lse) if return_lse else out


def serve(prepared: Prepared, *, plan=None):
    """``(out, lse)`` for a prepared call: cuDNN when it can serve it, else the exact path, counted and warned
    about once per reason (and refused in strict mode). An empty call is no fallback. A dense batch past cuDNN's grid
    limit is served as chunks that fit, each a call of its own (:mod:`~cudnn_attention.batch_chunks`), and a call whose
    backward passes cuDNN's element limit as groups of heads (:mod:`~cudnn_attention.head_groups`).

    ``plan``: already resolved for this call (a remembered key's). Otherwise the call is resolved, and its plan
    remembered under ``prepared.key`` when cuDNN serves it.
    """
    call, q, k, v, sinks, lengths = prepared.call, prepared.q, prepared.k, prepared.v, prepared.sinks, prepared.lengths
    if plan is None:
        empty = validation.nothing_to_compute(q, k, max_seqlen_q=call.max_seqlen_q, max_seqlen_kv=call.max_seqlen_kv)
        count = 1 if empty else batch_chunks.chunk_count(prepared)
        if count > 1:
            return batch_chunks.joined([serve(part) for part in batch_chunks.chunks(prepared, count)])
        count = 1 if empty else head_groups.group_count(prepared)
        if count > 1:
            return head_groups.joined([serve(part) for part in head_groups.groups(prepared, count)])
        plan, reason = (None, None) if empty else plans.resolve(q, k, v, call)
        if plan is not None and prepared.key is not None:
            memoize(prepared.key, (call, plan), plan.specs)
    else:
        empty, reason = False, None
    if not empty and reason is None:
        # The kernels read the sinks as H consecutive float32 values (no stride): a strided view is made dense, as
        # any other dtype is converted (both differentiable, both free when the sinks already are so).
        sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
        return cudnn_forward(plan, call, q, k, v, sinks=sinks, lengths=lengths)
    # While tracing, the bookkeeping goes into the graph (fallback_in_graph): Dynamo cannot run it, and
    # doing it at trace time would count once per compile and read strict mode only then.
    compiling = torch.compiler.is_compiling()
    if reason is not None and not compiling:
        note_fallback("forward", reason, caller_depth=2)  # raises in strict mode, before any work
    out, lse = exact_attention(call, q, k, v, sinks=sinks, lengths=lengths)
    if reason is not None:
        if compiling:
            out = fallback_in_graph(out, reason)
        else:
            out, lse = fallback_outputs(out, lse, reason, needs_grad=call.needs_grad)
    return out, lse
