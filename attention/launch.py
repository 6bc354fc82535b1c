"""Launching a built graph: the frontend, handles, workspaces, per-call operands, and the forward and backward runs.

Nothing here reads a device value back to the host, and nothing here calls back up into the plan or the ops:
a run gets its graphs (a :class:`~cudnn_attention.plan.Plan`, or one backward graph) and the call's tensors.

Execution hands the lowered backend plan a raw array of operand pointers in the order the backend keeps them,
when the frontend exposes that (see :func:`cudnn_attention._compat.backend_operand_uids`), else a ``{uid:
pointer}`` map; ``CUDNN_ATTENTION_PUBLIC_EXECUTE=1`` forces the public ``pygraph.execute``. Workspaces are kept
per device and stream, as torch keeps cuBLAS's. Why: docs/decisions/0004-execute-the-prebuilt-backend-plan.md and
0005-remembered-calls-and-raw-pointer-launches.md.
"""

from __future__ import annotations

import array
import threading

import torch

from . import _compat
from .call import Lengths
from .fused_sinks import fold_sinks, sink_gradient
from .layouts import allocate_backward_outputs, allocate_forward_outputs
from .packed_rows import fill_past_last_document, fill_rows
from .policy import count_cudnn, note_copy

__all__ = [
    "aligned",
    "bound_handle",
    "clear_workspaces",
    "cudnn_version",
    "execute",
    "frontend",
    "frontend_unavailable_reason",
    "release_handles",
    "run_backward",
    "run_forward",
]

# Workspaces up to this size are kept per (device, stream) between calls; larger ones (a packed
# backward's dQ accumulator can take hundreds of MiB) come from the caching allocator each call.
_KEPT_WORKSPACE_BYTES = 64 << 20

# ----------------------------------------------------------------------------------------------
# Frontend, handles and streams
# ----------------------------------------------------------------------------------------------

_frontend = None
_frontend_error: str | None = None


def frontend():
    """The ``cudnn`` frontend module, or None when it cannot be imported (see :func:`frontend_unavailable_reason`)."""
    global _frontend, _frontend_error
    if _frontend is None and _frontend_error is None:
        try:
            import cudnn

            _frontend = cudnn
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
            _frontend_error = f"cuDNN frontend not importable ({type(exc).__name__}: {exc})"
    return _frontend


def frontend_unavailable_reason() -> str | None:
    """``None`` when ``import cudnn`` works, else why not (cached after the first try)."""
    frontend()
    return _frontend_error


_cudnn_version: list = []


def cudnn_version() -> int | None:
    """The version of the cuDNN library the frontend loaded (``cudnn.backend_version()``, 91900 is 9.19.0), which runs
    the graphs (torch may have loaded another); None without a frontend or a library. Read once."""
    if not _cudnn_version:
        version = None
        if frontend() is not None:
            try:
                version = int(_frontend.backend_version())
            except Exception:  # noqa: BLE001 - no loadable libcudnn: no graph is built either
                version = None
        _cudnn_version.append(version)
    return _cudnn_version[0]


_thread_state = threading.local()


def bound_handle(device_index: int):
    """``(handle, stream)``: this thread's cuDNN handle for the device, bound to torch's current stream.

    cuDNN handles are not thread-safe, hence one per thread; the stream is rebound only when it
    changes (``set_stream`` costs about 5 us).
    """
    handles = getattr(_thread_state, "handles", None)
    if handles is None:
        handles = _thread_state.handles = {}
    entry = handles.get(device_index)
    if entry is None:
        with torch.cuda.device(device_index):
            entry = handles[device_index] = [frontend().create_handle(), None]
    stream = _compat.current_raw_stream(device_index)
    if entry[1] != stream:
        _frontend.set_stream(handle=entry[0], stream=stream)
        entry[1] = stream
    return entry[0], stream


# (device index, raw stream) -> uint8 buffer. Launches on one stream run in order, so one buffer
# serves them all; a stream torch hands out is never destroyed (it comes from a fixed pool), so a
# raw handle names the same queue for the life of the process.
_workspaces: dict = {}


def _workspace(size: int, device: torch.device, stream: int):
    """A buffer of at least ``size`` bytes for a launch on ``stream`` (None for no workspace). While a
    CUDA graph is captured, a fresh one from the graph's pool: a replay may run beside eager launches."""
    if not size:
        return None
    if size > _KEPT_WORKSPACE_BYTES or torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.uint8, device=device)
    key = (device.index, stream)
    buffer = _workspaces.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = _workspaces[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return buffer


def clear_workspaces() -> None:
    """Drop the kept workspaces (with the graph cache: a changed environment, tests)."""
    _workspaces.clear()


def release_handles() -> None:
    """Drop this thread's handles (at exit: see ``cudnn_graphs._release_at_exit``); other threads' die with them."""
    _thread_state.__dict__.pop("handles", None)


def execute(graph, operands: list, device_index: int) -> None:
    """Launch ``graph`` on torch's current stream with ``operands`` in the graph's uid order. Only each
    operand's address is read (the graph holds the dims and strides), so an LSE or a length vector goes in
    as it is, not viewed to the graph's (B, H, S, 1) dims; the public ``pygraph.execute`` takes them the same
    way (``test_every_launch_path_gives_the_same_bits``)."""
    handle, stream = bound_handle(device_index)
    workspace = _workspace(graph.workspace_size, operands[0].device, stream)
    workspace_ptr = workspace.data_ptr() if workspace is not None else 0
    if graph.pointer_order is not None:
        pointers = array.array("Q", [operands[i].data_ptr() for i in graph.pointer_order])
        _compat.execute_pointer_array(graph.lowered, pointers, workspace_ptr, graph.cpp_index, handle.backend_handle)
    elif graph.lowered is not None:
        pointers = {uid: t.data_ptr() for uid, t in zip(graph.uids, operands)}
        _compat.execute_lowered(graph.lowered, pointers, workspace_ptr, graph.cpp_index, handle.backend_handle)
    else:
        graph.graph.execute(operands, workspace, handle=handle, tensor_uids=graph.uids)


# ----------------------------------------------------------------------------------------------
# Per-call operands
# ----------------------------------------------------------------------------------------------


def aligned(t: torch.Tensor, name: str) -> torch.Tensor:
    # cuDNN descriptors need a 16-byte aligned base; equal strides with an odd offset would fault.
    if t.data_ptr() % 16:
        note_copy(f"{name} (alignment)", f"cudnn_attention: copying {name} to a 16-byte aligned buffer on each such call (said once)")
        return torch.empty_like(t).copy_(t)
    return t


def _length_operands(graph, lengths: Lengths, device: torch.device) -> list:
    """Per-batch lengths and ragged offsets, computed on the device (no host reads). Packed: about
    ten small kernels, so they are kept in the batch (:meth:`~cudnn_attention.packed_batch.PackedBatch.derived`):
    every layer of a forward and every backward of the same batch reuses them. An unpadded dense call whose graph has a
    padding mask (an erratum's reroute) passes full lengths."""
    batch = lengths.batch
    if batch is None:
        if lengths.seqlens_q is None:
            return [] if graph.full_lengths is None else _full_lengths(graph.full_lengths, device)
        return [aligned(lengths.seqlens_q, "seqlens_q"), aligned(lengths.seqlens_kv, "seqlens_kv")]
    return batch.derived(
        ("ragged operands", graph.batch, graph.ragged_columns), lambda: _ragged_operands(graph, batch.cu_seqlens_q, batch.cu_seqlens_kv)
    )


# (device, B, S_q, S_kv) -> [lengths_q, lengths_kv]: every length full, for an unpadded call whose graph has a padding
# mask (an erratum's reroute, see cudnn_graphs._around_errata). Made once, outside any CUDA graph capture.
_full_length_operands: dict = {}


def _full_lengths(shape: tuple, device: torch.device) -> list:
    key = (device, *shape)
    operands = _full_length_operands.get(key)
    if operands is None:
        B, S_q, S_kv = shape
        operands = [torch.full((B,), S_q, dtype=torch.int32, device=device), torch.full((B,), S_kv, dtype=torch.int32, device=device)]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return operands  # from the capture's pool: not to be kept past it
        _full_length_operands[key] = operands
    return operands


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


def _packed_absent_rows(cu_seqlens_rows, cu_seqlens_other, tokens: int) -> torch.Tensor:
    """(T, 1) bool: packed tokens of one side (``cu_seqlens_rows``'s) in no document (past its last entry) or in a
    document with no token on the other side: queries without a key, keys without a query."""
    document_T = (
        torch.searchsorted(
            cu_seqlens_rows, torch.arange(tokens, device=cu_seqlens_rows.device, dtype=cu_seqlens_rows.dtype), right=True, out_int32=True
        )
        - 1
    )
    has_other = torch.cat([cu_seqlens_other[1:] > cu_seqlens_other[:-1], cu_seqlens_other.new_zeros(1, dtype=torch.bool)])
    return ~has_other[document_T].unsqueeze(-1)


def _absent_rows(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(absent_q, absent_kv)``, (T, 1) bool each (:func:`_packed_absent_rows` of either side), derived together once per
    batch: at its first call (a forward, where memory is low), not at the first backward, whose peak the temporaries of
    the derivation would raise."""
    cu_q, cu_kv = batch.cu_seqlens_q, batch.cu_seqlens_kv
    return batch.derived(
        ("absent rows",),
        lambda: (_packed_absent_rows(cu_q, cu_kv, batch.tokens_q), _packed_absent_rows(cu_kv, cu_q, batch.tokens_kv)),
    )


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------

# The packed rows the kernels leave unwritten (a capacity tail; with two prefix-sum tensors, also queries without keys)
# are set by one pass after the kernels instead of zero fills before them, from this many query elements (T x H x D)
# on. On the H200 machine the pass took 3-4 us of device time against 50 us for the fills of dQ/dK/dV at gpt-oss's
# shape, but 31-36 us of host time per launch: at the host table's tiny shape it added about 40 us to a packed forward.
# Below this size a fill costs the device a few microseconds and a call is bound by its host time, so the fills stay.
_PASS_AFTER_MIN_ELEMENTS = 1 << 22


def _writes_every_row(graph, lengths: Lengths) -> bool:
    """Whether the kernels of this packed call write every row (see :meth:`~cudnn_attention.packed_batch.PackedBatch.writes_every_row`)."""
    return lengths.batch is not None and lengths.batch.writes_every_row(graph.mask)


def _rows_set_after(graph, q: torch.Tensor, lengths: Lengths) -> bool:
    """Whether this packed call's unwritten rows are set after its kernels (:func:`_set_unwritten_rows`), not filled first."""
    return lengths.batch is not None and not _writes_every_row(graph, lengths) and q.numel() >= _PASS_AFTER_MIN_ELEMENTS


def _set_unwritten_rows(graph, lengths: Lengths, query_fills: list, key_fills: tuple | list = ()) -> None:
    """Set the rows the packed kernels left unwritten: ``(tensor, value)`` of the query side's outputs (O, the LSE, dQ)
    and of the key side's (dK, dV). One prefix-sum tensor leaves only its tail; two may also leave the queries of a
    document without keys (cuDNN 9.19 was seen to write the keys of a document without queries; they are set all the
    same, as nothing promises it: ``benchmarks/unwritten_rows.py``)."""
    if lengths.batch.leaves_only_a_tail(graph.mask):
        fill_past_last_document(lengths.cu_seqlens_q, [*query_fills, *key_fills])
        return
    absent_q, absent_kv = _absent_rows(lengths.batch)
    fill_rows([(t, absent_q, value) for t, value in query_fills] + [(t, absent_kv, value) for t, value in key_fills])


def run_forward(plan, q, k, v, sinks, lengths: Lengths, need_lse: bool):
    """``(out, lse)`` of ``plan``'s forward (``lse`` None unless ``need_lse``); q/k/v are 16-byte aligned (:func:`aligned`)."""
    graph, folds = plan.forward, plan.folds_sinks
    seqlens_q = lengths.seqlens_q
    padded, packed = seqlens_q is not None, lengths.cu_seqlens_q is not None
    every_row = _writes_every_row(graph, lengths)
    # The fold writes every row, absent ones as zero and -inf: a packed out and LSE need no fill then.
    set_after = _rows_set_after(graph, q, lengths) and not folds
    out, lse = allocate_forward_outputs(
        q,
        v,
        packed=packed,
        need_lse=need_lse or folds,
        out_strides=graph.out_strides,
        zero_tails=not (folds or every_row or set_after),
    )
    # Operands are read for their addresses alone (see execute): no (B, H, S, 1) views of the LSE or sinks.
    operands = [q, k, v, out]
    if lse is not None:
        operands.append(lse)
    if sinks is not None and not folds:
        operands.append(aligned(sinks, "sinks"))
    operands += _length_operands(graph, lengths, q.device)
    execute(graph, operands, q.device.index)
    invalid_B1S1 = _padding_rows(seqlens_q, q.shape[2]) if padded else None
    if folds:
        absent = None
        if padded:
            absent = invalid_B1S1[..., 0]
        elif packed and not every_row:
            absent = _absent_rows(lengths.batch)[0]
        fold_sinks(out, lse, sinks, absent)
        if not need_lse:
            lse = None
    elif padded:
        out.masked_fill_(invalid_B1S1, 0)
        if lse is not None:
            lse.masked_fill_(invalid_B1S1[..., 0], float("-inf"))
    elif set_after:
        _set_unwritten_rows(graph, lengths, [(out, 0.0)] + ([(lse, float("-inf"))] if lse is not None else []))
    count_cudnn("forward")
    return out, lse


def run_backward(graph, grad_out, q, k, v, out, lse, sinks, lengths: Lengths, grad_lse=None):
    """``(dq, dk, dv, dsinks)``; ``dsinks`` is None without sinks. q/k/v/out are 16-byte aligned (the
    op's backward aligns what it was handed; the eager path saved the aligned ones its forward ran on).

    ``grad_out`` or ``grad_lse`` may be None (the loss did not use that output), not both. The output's
    gradient is one launch of ``graph``; the LSE's is one more launch of the same graph on stand-in
    operands (:func:`_lse_gradient_operands`), whose dQ and dK are exactly the LSE's share."""
    invalid_B1S1 = None if lengths.seqlens_q is None else _padding_rows(lengths.seqlens_q, q.shape[2])
    packed = lengths.cu_seqlens_q is not None
    set_after = _rows_set_after(graph, q, lengths)
    zero_tails = not (_writes_every_row(graph, lengths) or set_after)
    length_operands = _length_operands(graph, lengths, q.device)
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
        if sinks is None and graph.one_key_per_row:
            # Exact math gives zero (every probability is 1, dP - D = dO . (v - O) = 0); the kernel's dP and D are two float32
            # sums in different orders, whose difference (about 1e-4 of dK on an H200) is rounding, not gradient.
            dq.zero_()
            dk.zero_()
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
    elif set_after:
        _set_unwritten_rows(graph, lengths, [(dq, 0.0)], [(dk, 0.0), (dv, 0.0)])
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
