"""cuDNN's attention graphs emulated on CPU, so the Python around the launches runs without a GPU.

The package's launch code (:mod:`cudnn_attention.launch`: operands, stand-in operands, extra launches, masks,
accumulation, the ops and their autograd) runs unchanged; only the graphs are replaced (:func:`emulated`), by
float64 math that does what a graph does with the operands it is handed. The forward writes O and the LSE (the
sink-inclusive ones when the graph has sinks); the backward recomputes the probabilities from the LSE it is
handed and writes

    dP = dO V^T,  D = rowsum(dO * O),  dS = P * (dP - D),  dQ = scale dS K,  dK = scale dS^T Q,  dV = P^T dO

(FlashAttention's backward, which cuDNN's implements; GQA sums dK and dV over each KV head's query heads), and, when
the backward graph holds the sinks, ``dSink_h = -sum over h's rows of exp(sink_h - LSE) D`` (cuDNN's ``dSink_token``). Like
the real graphs they read which keys each query sees from the call's mask and the length operands: a padded
call's per-row lengths, a packed call's prefix sums (the graphs take them as ragged offsets of unit stride here); and
like them a packed graph leaves the rows outside its documents as it found them.
Visibility follows ``reference64``'s rules, which the package's are tested against.

Legend: N batch (1 for packed calls, whose tokens are one long sequence with a block-diagonal mask), H query
heads, Q/K query/key positions, D head dim.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from cudnn_attention import _compat, cudnn_ops, graph_spec, launch
from cudnn_attention import plan as plans
from cudnn_attention.call import AttentionCall
from cudnn_attention.plan import Plan
from support.reference64 import _softmax_attention, dense_visibility, packed_visibility

__all__ = ["EmulatedGraph", "emulated", "plan_for"]


class EmulatedSpec(NamedTuple):
    direction: str
    serial: int  # in no graph cache: nothing is memoized on an emulated graph


class EmulatedGraph:
    """Stands in for a ``CompiledGraph``: the attributes the launch code reads, and the call it serves."""

    _serial = 0

    def __init__(self, direction: str, call: AttentionCall, *, has_sinks: bool = False, deterministic: bool = False):
        EmulatedGraph._serial += 1
        self.spec = EmulatedSpec(direction, EmulatedGraph._serial)
        self.call = call
        # Forward: the sink operand (cuDNN's sink engine); backward: the sinks in and dSink out (graph_spec.dsink_in_graph).
        self.has_sinks = has_sinks
        self.deterministic = deterministic  # a backward graph: the algorithm it was resolved for
        self.out_strides = None  # the launch code derives layouts itself
        self.grad_strides = None
        self.batch = call.documents  # packed: the document count the length operands are padded to (here: not padded)
        self.ragged_columns = (("q", 1), ("kv", 1)) if call.packed else ()  # the prefix sums themselves, after the lengths
        self.full_lengths = None  # a dense graph with a padding mask for an unpadded call (an erratum's reroute): never here
        self.one_key_per_row = call.mask.sees_at_most_one_key(packed=call.packed, seq_kv=call.max_seqlen_kv)
        self.mask = call.mask


def plan_for(call: AttentionCall) -> Plan:
    """The plan ``plan.build_plan`` would resolve, with emulated graphs: the sink engine or the fold as
    ``CUDNN_ATTENTION_SINK_FORWARD`` picks (``plan._asks_sink_engine``)."""
    folds = call.has_sinks and not plans._asks_sink_engine(call)
    deterministic = call.backward_deterministic()
    backward = _backward_graph(call, deterministic) if call.needs_grad else None
    forward = EmulatedGraph("forward", call, has_sinks=call.has_sinks and not folds)
    return Plan(forward, backward, folds, deterministic)


def _backward_graph(call: AttentionCall, deterministic: bool) -> EmulatedGraph:
    """The backward graph ``graph_spec.spec_for`` would ask for: holding the sinks where the (patched) cuDNN version says."""
    in_graph = graph_spec.dsink_in_graph(call, graph_spec.cudnn_version(), deterministic=deterministic)
    return EmulatedGraph("backward", call, has_sinks=in_graph, deterministic=deterministic)


@contextlib.contextmanager
def emulated(monkeypatch, *, op: bool = False):
    """Serve calls on CPU with emulated graphs; yields the launch counts by direction, and under ``"algorithms"`` the
    algorithm (``deterministic``) each backward launch's graph was resolved for. The eager bypass serves
    calls with gradients (plain tensors), unless ``op``: then the ops do, through CPU kernels registered until
    the end of the block (``_forward_cuda``/``_backward_cuda`` themselves)."""
    launches = {"forward": 0, "backward": 0, "algorithms": []}

    def execute(graph, operands, device_index):
        launches[graph.spec.direction] += 1
        if graph.spec.direction == "backward":
            launches["algorithms"].append(graph.deterministic)
        (_forward if graph.spec.direction == "forward" else _backward)(graph, operands)

    monkeypatch.setattr(launch, "execute", execute)

    # As the real plan.resolve: no plan while torch.compile traces (the op is what the graph gets).
    def resolve(q, k, v, call):
        return (None, None) if torch.compiler.is_compiling() else (plan_for(call), None)

    monkeypatch.setattr(plans, "resolve", resolve)
    # A backward whose algorithm setting changed since the forward resolves its graph again.
    monkeypatch.setattr(cudnn_ops, "backward_graph", lambda q, k, v, call, deterministic: _backward_graph(call, deterministic))
    if not op:
        yield launches
        return
    monkeypatch.setattr(cudnn_ops, "_eager_safe", lambda q, k, v: False)
    monkeypatch.setattr(cudnn_ops, "build_plan", lambda q, k, v, call, deterministic: plan_for(call))
    library = torch.library.Library("cudnn_attention", "IMPL")
    try:
        library.impl("forward", cudnn_ops._forward_cuda, "CPU")
        library.impl("backward", cudnn_ops._backward_cuda, "CPU")
        yield launches
    finally:
        _compat.destroy_library(library)


def _nhsd(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """(N, H, S, D) view: dense tensors are; packed (T, H, D) ones become (1, H, T, D). A view, so it writes through."""
    return t.permute(1, 0, 2).unsqueeze(0) if packed else t


def _nhs(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """(N, H, S) view of an LSE: dense (B, H, S) as is, packed (T, H) as (1, H, T)."""
    return t.t().unsqueeze(0) if packed else t


def _visibility(graph: EmulatedGraph, q, k, length_operands: list):
    """``(visible (N, Q, K), row_valid (N, Q))`` from the call's mask and the length operands."""
    mask = graph.call.mask
    options = dict(window_size=(mask.left, mask.right), bottom_right=mask.bottom_right)
    if graph.call.packed:
        _, _, cu_q, cu_kv = length_operands  # lengths (not read: the prefix sums say it all), then the ragged columns
        return packed_visibility(q.shape[0], k.shape[0], cu_q.view(-1), cu_kv.view(-1), **options)
    seqlens = length_operands if length_operands else (None, None)
    return dense_visibility(q.shape[0], q.shape[2], k.shape[2], *seqlens, **options)


def _forward(graph: EmulatedGraph, operands: list) -> None:
    q, k, v, out = operands[:4]
    floats = [t for t in operands[4:] if t.is_floating_point()]
    lengths = [t for t in operands[4:] if not t.is_floating_point()]
    # The LSE follows O when the call asks for it (or the fold needs it); the sinks, 1-D, follow that.
    lse = floats.pop(0) if floats and floats[0].dim() == out.dim() - 1 else None
    sinks = floats.pop(0) if graph.has_sinks else None
    assert not floats, "an operand the emulation does not know"
    p = graph.call.packed
    visible, row_valid = _visibility(graph, q, k, lengths)
    q_N, k_N, v_N = (_nhsd(t, p).double() for t in (q, k, v))
    N, H, Q, D = q_N.shape
    H_kv = k_N.shape[1]
    o, lse_value = _softmax_attention(
        q_N.reshape(N, H_kv, H // H_kv, Q, D),
        k_N,
        v_N,
        visible,
        row_valid,
        graph.call.scale,
        None if sinks is None else sinks.double(),
        torch.float64,
    )
    query_rows = row_valid if p else None  # packed: rows in a document with keys; dense: every row
    _write(_nhsd(out, p), o.reshape(N, H, Q, -1), query_rows)
    if lse is not None:
        _write(_nhs(lse, p).unsqueeze(-1), lse_value.reshape(N, H, Q, 1), query_rows)


def _backward(graph: EmulatedGraph, operands: list) -> None:
    q, k, v, out, grad_out, lse, dq, dk, dv = operands[:9]
    sinks, dsinks = operands[9:11] if graph.has_sinks else (None, None)
    lengths = operands[11:] if graph.has_sinks else operands[9:]
    p, scale = graph.call.packed, graph.call.scale
    visible, row_valid = _visibility(graph, q, k, lengths)
    q_N, k_N, v_N, o_N, do_N = (_nhsd(t, p).double() for t in (q, k, v, out, grad_out))
    lse_N = _nhs(lse, p).double()
    N, H, _, D = q_N.shape
    H_kv, K = k_N.shape[1], k_N.shape[2]
    G = H // H_kv
    k_rep, v_rep = k_N.repeat_interleave(G, dim=1), v_N.repeat_interleave(G, dim=1)  # query head h reads KV head h // G
    scores = scale * q_N @ k_rep.transpose(-1, -2)
    probs = torch.where(visible.unsqueeze(1), torch.exp(scores - lse_N.unsqueeze(-1)), 0.0)  # P from the LSE handed in
    row_dot = (do_N * o_N).sum(-1, keepdim=True)
    d_scores = probs * (do_N @ v_rep.transpose(-1, -2) - row_dot)
    if sinks is not None:  # dSink_h = -sum over h's rows of exp(sink_h - lse) D, as cuDNN's dSink_token writes it
        weight = torch.exp(sinks.double().view(1, -1, 1) - lse_N).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        dsinks.copy_(-(weight * row_dot.squeeze(-1)).sum((0, 2)))
    key_rows = _written_key_rows(K, lengths) if p else None
    _write(_nhsd(dq, p), scale * d_scores @ k_rep, row_valid if p else None)
    _write(_nhsd(dk, p), (scale * d_scores.transpose(-1, -2) @ q_N).reshape(N, H_kv, G, K, D).sum(2), key_rows)
    _write(_nhsd(dv, p), (probs.transpose(-1, -2) @ do_N).reshape(N, H_kv, G, K, -1).sum(2), key_rows)


# Packed graphs, as cuDNN's: rows outside the documents they compute are left as they were (a capacity tail, a document
# without keys, keys of a document without queries), so the launch code's fills and tail pass are what makes them exact.
# Dense graphs write every row (the launch code masks padded ones itself).


def _written_key_rows(K: int, length_operands: list) -> torch.Tensor:
    """(1, K) key rows a packed backward writes: those in a document with queries (the length operands force a
    document's query length to 0 where it has no key)."""
    lengths_q, cu_kv = length_operands[0].view(-1), length_operands[3].view(-1)
    documents = lengths_q.numel()
    document_K = torch.searchsorted(cu_kv, torch.arange(K, dtype=cu_kv.dtype), right=True) - 1
    inside_K = (document_K >= 0) & (document_K < documents)
    return (inside_K & (lengths_q[document_K.clamp(0, max(documents - 1, 0))] > 0)).view(1, K)


def _write(target: torch.Tensor, value: torch.Tensor, rows: torch.Tensor | None) -> None:
    """``target`` (N, H, S, D) = ``value`` on ``rows`` (N, S) (every row when None), untouched elsewhere."""
    if rows is None:
        target.copy_(value)
    else:
        target.copy_(torch.where(rows.view(rows.shape[0], 1, rows.shape[1], 1), value.to(target.dtype), target))
