"""Calls whose backward passes 2**31 elements, served as groups of heads that each stay below.

cuDNN 9.19's backward gets dQ and dK wrong in every row from element 2**31 of q on, with no error (errata entry
``backward-past-2**31-elements``): a gpt-oss-shaped packed batch (64 query heads x 64) reaches that at 524,288 tokens.
The first half of the heads of the same call came out right. Heads are independent (a query head reads only its kv
head), so such a call is the same call on consecutive groups of heads, each group of query heads with the kv heads it
reads: :func:`group_count` says how many, :func:`groups` cuts the prepared call (views of dense tensors; compact copies
of packed ones, the only layout cuDNN's packed backward reads right), and :func:`joined` puts the groups' outputs back
together along the heads. Each group is an ordinary call: it resolves, runs its backward and falls back on its own, and
autograd gives each group's slice of the sinks its gradient. Where even one kv head's queries are past the limit (MQA:
every query head reads the one kv head), a kv head's queries are cut into several groups that share that kv head: their
dK and dV add up, by autograd for the public API, by :func:`joined_gradients` (in float32) for the provider's ops.

What a grouped call costs beyond its groups: packed, one copy of q, k and v into the groups and of their gradients
back; one copy of the output (and of the LSE when asked for) into the joined tensor; through the provider's ops, whose
backward gets the joined output, one more copy of it back into the groups' layouts (:func:`saved_heads`). Only calls
that will run a backward are grouped (the forward was right past the limit), and only on a cuDNN whose version has the
entry. A call that no grouping brings below (one query head still past it) stays whole, and its backward graph is
refused: the exact path.

Legend: B batch, T tokens, H heads, S sequence, D head dim.
"""

from __future__ import annotations

import torch

from . import dtypes, errata
from .call import Prepared
from .frontend import cudnn_version
from .layouts import allocate_forward_outputs, backward_rows, joined_results, split_evenly, token_major
from .plan import device_unservable_reason

__all__ = ["HEADS", "element_limited_on", "group_count", "groups", "joined", "joined_gradients", "saved_heads"]

HEADS = 1  # the heads' dimension of q, k, v, the output and the LSE: dense (B, H, S, D), packed (T, H, D)


def group_count(prepared: Prepared) -> int:
    """How many head groups cuDNN serves this call in: 1, or the fewest groups whose backward stays within
    :data:`~cudnn_attention.errata.ELEMENT_LIMIT`, for a call that will run a backward past it in a dtype cuDNN takes, on
    a device cuDNN may serve and a cuDNN with the entry (:func:`element_limited_on`). A count divides H_q and either
    divides H_kv (each group whole kv heads) or is a multiple of it (each kv head's queries in count / H_kv groups), so
    that no group's query heads read more than its kv heads. Host metadata only."""
    call = prepared.call
    if not call.needs_grad:  # first and alone: a forward-only call never asks
        return 1
    q, k, v = prepared.q, prepared.k, prepared.v
    # Every call that runs a backward asks, so a bound from the element counts comes first: a graph's rows are at most
    # twice a tensor's, or 64 (layouts.backward_rows), and O and dO hold D_v / D of q's elements.
    q_shape, dim_v = q.shape, v.shape[-1]
    dim_qk = q_shape[-1]
    if max(2 * max(q.numel(), k.numel()) // max(dim_qk, 1), 64 * q_shape[HEADS]) * max(dim_qk, dim_v) <= errata.ELEMENT_LIMIT:
        return 1
    rows_q, rows_kv = backward_rows(packed=call.packed, q=q, k=k)
    sizes = dict(rows_q=rows_q, rows_kv=rows_kv, dim_qk=dim_qk, dim_v=dim_v)
    heads_q, heads_kv = q_shape[HEADS], k.shape[HEADS]
    if not errata.past_element_limit(heads_q=heads_q, heads_kv=heads_kv, **sizes):
        return 1
    # A call cuDNN cannot serve anyway takes the exact path whole: one fallback, counted once.
    if not dtypes.cudnn_serves(q.dtype, backward=True) or not element_limited_on(q.device.type):
        return 1
    for count in range(2, heads_q + 1):
        if _cuts_evenly(heads_q, heads_kv, count) and not errata.past_element_limit(
            heads_q=heads_q // count, heads_kv=max(heads_kv // count, 1), **sizes
        ):
            return count
    return 1


def _cuts_evenly(heads_q: int, heads_kv: int, count: int) -> bool:
    """Whether ``count`` groups of consecutive query heads each read whole kv heads, or a part of one kv head's."""
    return heads_q % count == 0 and (heads_kv % count == 0 or count % heads_kv == 0)


# Constant for the process (the device type's frontend, the library it loaded), so torch.compile reads it once while
# tracing instead of tracing into the frontend's loading.
@torch.compiler.assume_constant_result
def element_limited_on(device_type: str) -> bool:
    """Whether cuDNN may serve calls on ``device_type`` and the cuDNN it loaded gets a backward past the element limit
    wrong (:func:`~cudnn_attention.errata.element_limited`)."""
    return device_unservable_reason(device_type) is None and errata.element_limited(cudnn_version())


def groups(prepared: Prepared, count: int) -> list[Prepared]:
    """``prepared`` cut into ``count`` consecutive groups of heads (views of its tensors; compact copies when packed):
    group i holds query heads ``[i H / count, (i + 1) H / count)``, the kv heads ``[i H_kv / count, ...)`` they read
    where ``count`` divides H_kv, else the one kv head ``i H_kv / count`` (the same tensor for the ``count / H_kv``
    groups that read it), and their sinks. The groups carry no served key: a key names the whole call's shapes."""
    heads_kv = prepared.k.shape[HEADS]
    kv_count = min(count, heads_kv)
    q_parts, k_parts, v_parts = (
        split_evenly(t, n, HEADS) for t, n in ((prepared.q, count), (prepared.k, kv_count), (prepared.v, kv_count))
    )
    if prepared.call.packed:
        # A group's heads of a (T, H, D) tensor are interleaved with the other groups' (token stride H x D), and cuDNN
        # 9.19's packed backward reads only compact token-major operands (layouts.token_major; as views, the groups' dQ
        # came out wrong on an H200): each packed group gets a compact copy, differentiable like the views.
        q_parts, k_parts, v_parts = ([token_major(t) for t in parts] for parts in (q_parts, k_parts, v_parts))
    share = count // kv_count  # groups that read each kv head: one copy of it serves them all
    k_parts, v_parts = ([parts[i // share] for i in range(count)] for parts in (k_parts, v_parts))
    sink_parts = [None] * count if prepared.sinks is None else split_evenly(prepared.sinks, count, 0)
    return [Prepared(prepared.call, *parts, prepared.lengths) for parts in zip(q_parts, k_parts, v_parts, sink_parts)]


def saved_heads(parts: list[Prepared], grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> list[tuple]:
    """Per group, its heads of a whole call's backward inputs (the provider's backward op gets the joined output and
    LSE): the incoming gradient as a view, the output and the LSE copied into the buffers the group's own forward would
    have written (:func:`~cudnn_attention.layouts.allocate_forward_outputs`), whose layouts its backward graph reads; the
    heads of one tensor are not a compact tensor."""
    saved = []
    pieces = (split_evenly(t, len(parts), HEADS) for t in (grad_out, out, lse))
    for part, grad_out_part, out_part, lse_part in zip(parts, *pieces):
        laid_out, lse_laid_out = allocate_forward_outputs(part.q, part.v, packed=part.call.packed, need_lse=True, zero_tails=False)
        saved.append((grad_out_part, laid_out.copy_(out_part), lse_laid_out.copy_(lse_part)))
    return saved


def joined(parts: list) -> tuple:
    """The whole call's results from its groups' result tuples, joined along the heads in the memory order of the first's
    (:func:`~cudnn_attention.layouts.joined_results`)."""
    return joined_results(parts, HEADS)


def joined_gradients(groups: list[Prepared], results: list[tuple]) -> tuple:
    """The whole call's ``(dq, dk, dv, dsinks)`` from its groups' (the provider's backward op, below autograd): dQ and
    dSink joined along the heads; the dK and dV of groups that share a kv head (:func:`groups`) added up first, in
    float32 and rounded once, as one kernel's GQA reduction would."""
    share = sum(group.k is groups[0].k for group in groups)
    if share == 1:
        return joined(results)
    dq, dsinks = joined([(result[0], result[3]) for result in results])
    # Groups that share a kv head are consecutive (groups): each run of `share` results is one kv head's.
    dk, dv = joined(
        [
            tuple(_sum_in_float32([result[i] for result in results[start : start + share]]) for i in (1, 2))
            for start in range(0, len(results), share)
        ]
    )
    return dq, dk, dv, dsinks


def _sum_in_float32(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].to(torch.float32, copy=True)  # a copy even of float32: the sum goes into it
    for t in tensors[1:]:
        total.add_(t)
    return total.to(tensors[0].dtype)
