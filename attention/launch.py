"""Launching built graphs: :func:`execute` (one graph on torch's current stream), and the forward and backward runs of
a call (:func:`run_forward`, :func:`run_backward`): outputs allocated, operands passed, the rows packed kernels leave
unwritten set, the sinks folded in and their gradient taken, the LSE's gradient added.

Nothing here reads a device value back to the host, and nothing here calls back up into the plan or the ops:
a run gets its graphs (a :class:`~cudnn_attention.plan.Plan`, or one backward graph) and the call's tensors.

Execution hands the lowered backend plan a raw array of operand pointers in the order the backend keeps them,
when the frontend exposes that (see :func:`cudnn_attention._compat.backend_operand_uids`), else a ``{uid:
pointer}`` map; ``CUDNN_ATTENTION_PUBLIC_EXECUTE=1`` forces the public ``pygraph.execute``. Why:
docs/decisions/0004-execute-the-prebuilt-backend-plan.md and 0005-remembered-calls-and-raw-pointer-launches.md.
"""

from __future__ import annotations

import array

import torch

from . import _compat
from .call import Lengths
from .frontend import bound_handle, workspace
from .fused_sinks import fold_sinks, sink_gradient
from .layouts import allocate_backward_outputs, allocate_forward_outputs
from .lse_gradient import lse_gradient_operands, lse_sink_gradient, masked_lse_gradient
from .operands import absent_rows, aligned, length_operands, padding_rows
from .packed_rows import fill_past_last_document, fill_rows
from .policy import count_cudnn

__all__ = ["execute", "run_backward", "run_forward"]


def execute(graph, operands: list, device_index: int) -> None:
    """Launch ``graph`` on torch's current stream with ``operands`` in the graph's uid order. Only each
    operand's address is read (the graph holds the dims and strides), so an LSE or a length vector goes in
    as it is, not viewed to the graph's (B, H, S, 1) dims; the public ``pygraph.execute`` takes them the same
    way (``test_every_launch_path_gives_the_same_bits``)."""
    handle, stream = bound_handle(device_index)
    buffer = workspace(graph.workspace_size, operands[0].device, stream)
    workspace_ptr = buffer.data_ptr() if buffer is not None else 0
    if graph.pointer_order is not None:
        pointers = array.array("Q", [operands[i].data_ptr() for i in graph.pointer_order])
        _compat.execute_pointer_array(graph.lowered, pointers, workspace_ptr, graph.cpp_index, handle.backend_handle)
    elif graph.lowered is not None:
        pointers = {uid: t.data_ptr() for uid, t in zip(graph.uids, operands)}
        _compat.execute_lowered(graph.lowered, pointers, workspace_ptr, graph.cpp_index, handle.backend_handle)
    else:
        graph.graph.execute(operands, buffer, handle=handle, tensor_uids=graph.uids)


# The packed rows the kernels leave unwritten (a capacity tail; with two prefix-sum tensors, also queries without keys)
# are set by one pass after the kernels instead of zero fills before them, from this many query elements (T x H x D)
# on. On the H200 machine the pass took 3-4 us of device time against 50 us for the fills of dQ/dK/dV at gpt-oss's
# shape, but 31-36 us of host time per launch: at the host table's tiny shape it added about 40 us to a packed forward.
# Below this size a fill costs the device a few microseconds and a call is bound by its host time, so the fills stay.
_PASS_AFTER_MIN_ELEMENTS = 1 << 22


def _writes_every_row(graph, lengths: Lengths) -> bool:
    """Whether the kernels of this packed call write every row (see :meth:`~cudnn_attention.packed_batch.PackedBatch.writes_every_row`)."""
    return lengths.batch is not None and lengths.batch.writes_every_row(graph.mask)


def _rows_set_after(q: torch.Tensor, lengths: Lengths, every_row: bool) -> bool:
    """Whether this packed call's unwritten rows are set after its kernels (:func:`_set_unwritten_rows`), not filled first
    (``every_row``: :func:`_writes_every_row`'s answer for the call)."""
    return lengths.batch is not None and not every_row and q.numel() >= _PASS_AFTER_MIN_ELEMENTS


def _set_unwritten_rows(graph, lengths: Lengths, query_fills: list, key_fills: tuple | list = ()) -> None:
    """Set the rows the packed kernels left unwritten: ``(tensor, value)`` of the query side's outputs (O, the LSE, dQ)
    and of the key side's (dK, dV). One prefix-sum tensor leaves only its tail; two may also leave the queries of a
    document without keys (cuDNN 9.19 was seen to write the keys of a document without queries; they are set all the
    same, as nothing promises it: ``benchmarks/unwritten_rows.py``)."""
    if lengths.batch.leaves_only_a_tail(graph.mask):
        fill_past_last_document(lengths.cu_seqlens_q, [*query_fills, *key_fills])
        return
    absent_q, absent_kv = absent_rows(lengths.batch)
    fill_rows([(t, absent_q, value) for t, value in query_fills] + [(t, absent_kv, value) for t, value in key_fills])


def run_forward(plan, q, k, v, sinks, lengths: Lengths, need_lse: bool):
    """``(out, lse)`` of ``plan``'s forward (``lse`` None unless ``need_lse``); q/k/v are 16-byte aligned (:func:`aligned`)."""
    graph, folds = plan.forward, plan.folds_sinks
    seqlens_q = lengths.seqlens_q
    padded, packed = seqlens_q is not None, lengths.batch is not None
    every_row = _writes_every_row(graph, lengths)
    # The fold writes every row, absent ones as zero and -inf: a packed out and LSE need no fill then.
    set_after = _rows_set_after(q, lengths, every_row) and not folds
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
    operands += length_operands(graph, lengths, q.device)
    execute(graph, operands, q.device.index)
    invalid_B1S1 = padding_rows(seqlens_q, q.shape[2]) if padded else None
    if folds:
        absent = None
        if padded:
            absent = invalid_B1S1[..., 0]
        elif packed and not every_row:
            absent = absent_rows(lengths.batch)[0]
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
    operands (:func:`~cudnn_attention.lse_gradient.lse_gradient_operands`), whose dQ and dK are exactly the LSE's share."""
    invalid_B1S1 = None if lengths.seqlens_q is None else padding_rows(lengths.seqlens_q, q.shape[2])
    packed = lengths.batch is not None
    every_row = _writes_every_row(graph, lengths)
    set_after = _rows_set_after(q, lengths, every_row)
    zero_tails = not (every_row or set_after)
    index_operands = length_operands(graph, lengths, q.device)
    # A graph that holds the sinks writes dSink itself (graph_spec.dsink_in_graph); the LSE's launch below writes one
    # too, from stand-in operands: it goes to a scratch buffer, as the LSE's own share comes in closed form.
    sink_operands = (lambda: [aligned(sinks, "sinks"), sinks.new_empty(sinks.shape[0])]) if graph.has_sinks else list
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
        in_graph = sink_operands()
        execute(graph, [q, k, v, out, grad_out, lse, dq, dk, dv, *in_graph, *index_operands], q.device.index)
        if sinks is None and graph.one_key_per_row:
            # Exact math gives zero (every probability is 1, dP - D = dO . (v - O) = 0); the kernel's dP and D are two float32
            # sums in different orders, whose difference (about 1e-4 of dK on an H200) is rounding, not gradient.
            dq.zero_()
            dk.zero_()
        if in_graph:
            dsinks = in_graph[1]
        elif sinks is not None:
            dsinks = sink_gradient(grad_out, out, lse, sinks)
    if grad_lse is not None:
        dlse = masked_lse_gradient(grad_lse, lse)
        v_zero, o_unit, do_lse = lse_gradient_operands(dlse, out, v)
        lse_dq, lse_dk, lse_dv = allocate_backward_outputs(
            q, k, v, packed=packed, padded=invalid_B1S1 is not None, grad_strides=graph.grad_strides, zero_tails=zero_tails
        )
        execute(graph, [q, k, v_zero, o_unit, do_lse, lse, lse_dq, lse_dk, lse_dv, *sink_operands(), *index_operands], q.device.index)
        if dq is None:
            # This launch's dV' = P^T dO' belongs to no gradient (the LSE does not depend on V): its buffer becomes dV's zeros.
            dq, dk, dv = lse_dq, lse_dk, lse_dv.zero_()
        else:
            dq.add_(lse_dq)
            dk.add_(lse_dk)
        if sinks is not None:
            lse_dsinks = lse_sink_gradient(dlse, lse, sinks)
            dsinks = lse_dsinks if dsinks is None else dsinks + lse_dsinks
    if invalid_B1S1 is not None:
        dq.masked_fill_(invalid_B1S1, 0)
    elif set_after:
        _set_unwritten_rows(graph, lengths, [(dq, 0.0)], [(dk, 0.0), (dv, 0.0)])
    count_cudnn("backward")
    return dq, dk, dv, dsinks
