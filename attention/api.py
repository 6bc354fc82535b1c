"""Public entry points: :func:`attention` (dense) and :func:`varlen_attention` (packed).

Each call is served by cuDNN when it can be, else by the exact PyTorch path, which is counted in
:func:`cudnn_attention.stats`, warned about once per reason, and refused in strict mode.

A call cuDNN served is remembered by its arguments' signature (:func:`_call_signature`): the next
call with the same shapes, strides, dtypes, devices and options was validated already and resolves
to the same plan, so it goes straight to the kernels.
"""

from __future__ import annotations

import torch

from . import cudnn_ops, validation
from .call import NO_LENGTHS, AttentionCall, Lengths
from .cudnn_graphs import memoize, memoized
from .cudnn_ops import cudnn_forward, resolve_cudnn
from .layouts import token_major
from .masking import effective_lengths, is_int_window, make_mask_spec
from .policy import fallback_in_graph, fallback_outputs, note_fallback
from .reference import exact_attention

__all__ = ["attention", "serve", "varlen_attention"]


def _needs_grad(q, k, v, sinks) -> bool:
    # Plain boolean logic rather than any(generator): this runs on every call.
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad))


def _call_signature(q, k, v, scale, causal, bottom_right, window_size, sinks, return_lse, index_tensors, ints):
    """A key two calls share only when validation treats them alike and they resolve to the same plan:
    q/k/v's shapes, strides, dtypes and devices, the options, the index tensors' shapes, dtypes and
    devices (``index_tensors``; their values are read per call), ``ints`` (the packed maxima), whether
    gradients are needed, the determinism setting and the sink-forward choice. None (validate every
    time) for tensor subclasses, options of other types than the documented ones (``True == 1`` and
    ``1.0 == 1`` as keys, but validation tells them apart) and while tracing."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if not (scale is None or type(scale) is float) or type(causal) is not bool or type(bottom_right) is not bool:
        return None
    if not is_int_window(window_size):
        return None
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        return None
    index_key = []
    for t in index_tensors:
        if t is None:
            index_key.append(None)
        elif isinstance(t, torch.Tensor):
            index_key.append((t.shape, t.dtype, t.device))
        else:
            return None
    for n in ints:
        if type(n) is not int:
            return None
    if torch.compiler.is_compiling():
        return None
    return (
        q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device,
        scale, causal, bottom_right, window_size, bool(return_lse), _needs_grad(q, k, v, sinks),
        None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),
        tuple(index_key), ints,
        torch.are_deterministic_algorithms_enabled(), cudnn_ops.SINK_FORWARD,
    )  # fmt: skip


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
    signature = None if validate else _call_signature(q, k, v, scale, causal, bottom_right, window_size, sinks, return_lse, (seqlens_q, seqlens_kv), ())
    served = None if signature is None else memoized(signature)
    if served is not None:
        call, plan = served
        lengths = _padding_lengths(seqlens_q, seqlens_kv, q.shape[0], q.shape[2], k.shape[2], q.device) if call.padded else NO_LENGTHS
        out, lse = serve(call, q, k, v, sinks=sinks, lengths=lengths, plan=plan)
        return (out, lse) if return_lse else out
    given = (q, k, v)
    q, k, v = validation.check_qkv(q, k, v, packed=False)
    mask = make_mask_spec(causal=causal, bottom_right=bottom_right, window_size=window_size)
    q, scale = validation.positive_scale(q, validation.resolve_scale(scale, q.shape[-1]))
    sinks = validation.check_sinks(sinks, q, q.shape[1])
    B, S_q, S_kv = q.shape[0], q.shape[2], k.shape[2]
    seqlens_q = validation.check_seqlens(seqlens_q, "seqlens_q", B, q.device)
    seqlens_kv = validation.check_seqlens(seqlens_kv, "seqlens_kv", B, q.device)
    if validate:
        for name, lengths, limit in (("seqlens_q", seqlens_q, S_q), ("seqlens_kv", seqlens_kv, S_kv)):
            if lengths is not None:
                validation.validate_seqlens(lengths, name, limit)
    padded = seqlens_q is not None or seqlens_kv is not None
    lengths = _padding_lengths(seqlens_q, seqlens_kv, B, S_q, S_kv, q.device) if padded else NO_LENGTHS
    needs_grad = _needs_grad(q, k, v, sinks)
    call = AttentionCall(False, padded, 0, S_q, S_kv, scale, mask, sinks is not None, return_lse or needs_grad, needs_grad)
    out, lse = serve(call, q, k, v, sinks=sinks, lengths=lengths, signature=signature if _unchanged(given, q, k, v) else None)
    return (out, lse) if return_lse else out


def _unchanged(given, q, k, v) -> bool:
    # Identity, not ==: a tuple compares unequal tensors elementwise.
    return given[0] is q and given[1] is k and given[2] is v


def _padding_lengths(seqlens_q, seqlens_kv, B: int, S_q: int, S_kv: int, device) -> Lengths:
    """A padded call's per-row lengths as the kernels take them; an absent side is the full length."""
    return Lengths(*effective_lengths(
        seqlens_q if seqlens_q is not None else torch.full((B,), S_q, dtype=torch.int32, device=device),
        seqlens_kv if seqlens_kv is not None else torch.full((B,), S_kv, dtype=torch.int32, device=device),
        S_q, S_kv,
    ))  # fmt: skip


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
    validate: bool = False,
):
    """Attention over packed documents: (T, H, D) tensors and int32/int64 prefix sums of lengths.

    Document b holds tokens ``cu_seqlens[b]:cu_seqlens[b + 1]`` of each side; no token attends
    outside its document. ``max_seqlen_*`` (Python ints in ``[0, T]`` of their side) bound the
    longest document. Tokens past ``cu_seqlens[-1]`` (a capacity tail) get a zero output and zero
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
    signature = None
    if not validate:
        signature = _call_signature(q, k, v, scale, causal, bottom_right, window_size, sinks, return_lse, (cu_seqlens_q, cu_seqlens_kv),
                                    (max_seqlen_q, max_seqlen_kv))  # fmt: skip
    served = None if signature is None else memoized(signature)
    if served is None:
        given = (q, k, v)
        q, k, v = validation.check_qkv(q, k, v, packed=True)
        validation.check_cu_seqlens(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, q.device, total_q=q.shape[0],
                                    total_kv=k.shape[0])  # fmt: skip
        mask = make_mask_spec(causal=causal, bottom_right=bottom_right, window_size=window_size)
        q, scale = validation.positive_scale(q, validation.resolve_scale(scale, q.shape[-1]))
        sinks = validation.check_sinks(sinks, q, q.shape[1])
    validation.check_prefix_sums(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_kv, validate=validate)
    lengths = Lengths(None, None, cu_seqlens_q, cu_seqlens_kv)
    if served is not None:  # its q/k/v were token-major already (else they would have been copied, and the call not remembered)
        call, plan = served
        out, lse = serve(call, q, k, v, sinks=sinks, lengths=lengths, plan=plan)
        return (out, lse) if return_lse else out
    needs_grad = _needs_grad(q, k, v, sinks)
    if needs_grad:
        q, k, v = (token_major(t) for t in (q, k, v))  # see token_major: cuDNN's packed backward needs it
    call = AttentionCall(
        True, False, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_kv, scale, mask, sinks is not None, return_lse or needs_grad, needs_grad
    )
    out, lse = serve(call, q, k, v, sinks=sinks, lengths=lengths, signature=signature if _unchanged(given, q, k, v) else None)
    return (out, lse) if return_lse else out


def serve(call: AttentionCall, q, k, v, *, sinks, lengths: Lengths, plan=None, signature=None):
    """``(out, lse)`` for a validated call: cuDNN when it can serve it, else the exact path, counted
    and warned about once per reason (and refused in strict mode). An empty call is no fallback.

    ``plan``: already resolved for this call (a remembered signature's). ``signature``: the call's
    arguments' signature, remembered with the plan when cuDNN serves the call (None: the arguments
    were changed on the way, by a copy or a folded scale, so the next call must validate again).
    """
    if plan is None:
        empty = validation.nothing_to_compute(q, k, max_seqlen_q=call.max_seqlen_q, max_seqlen_kv=call.max_seqlen_kv)
        plan, reason = (None, None) if empty else resolve_cudnn(q, k, v, call)
        if plan is not None and signature is not None:
            memoize(signature, (call, plan), plan.specs)
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
