"""Output layouts and shape buckets shared by the real cuDNN kernels and their fake (meta) twins.

Keeping allocation in one place is what makes ``register_fake`` honest: the fake kernel calls the
same helpers as the real one, so compiled graphs plan for the strides that really materialize.
"""

from __future__ import annotations

import torch

from .errata import GRID_LIMIT

__all__ = [
    "allocate_backward_outputs",
    "allocate_forward_outputs",
    "backward_rows",
    "cat_in_memory_order",
    "joined_results",
    "like_layout_strides",
    "packed_bounds",
    "shape_bucket",
    "split_evenly",
    "thd_descriptor_strides",
    "token_major",
]


def like_layout_strides(shape: tuple[int, ...], like: torch.Tensor) -> tuple[int, ...]:
    """Compact strides for ``shape`` in ``like``'s dimension order (innermost first).

    A (B, S, H, D) buffer seen as (B, H, S, D) gives an output with the same physical order, so
    transformers' ``out.transpose(1, 2).reshape(B, S, -1)`` stays a view. Broadcast (stride-0)
    inputs have no order to copy and get contiguous strides.
    """
    strides = like.stride()
    if 0 in strides:
        return torch.empty(shape, device="meta").stride()
    order = sorted(range(len(shape)), key=lambda dim: (strides[dim], -dim))
    result = [0] * len(shape)
    step = 1
    for dim in order:
        result[dim] = step
        step *= shape[dim]
    return tuple(result)


def thd_descriptor_strides(t_THD: torch.Tensor, s_max: int) -> tuple[int, int, int, int]:
    """(B, H, S, D) descriptor strides of a packed (T, H, D) tensor with its real token/head strides.

    The batch stride is nominal: ragged offsets give each document's base.
    """
    s_t, s_h, s_d = t_THD.stride()
    return (s_max * s_t, s_h, s_t, s_d)


def token_major(t_THD: torch.Tensor) -> torch.Tensor:
    """``t_THD`` itself when it is a compact token-major (T, H, D) tensor, else a compact copy.

    cuDNN 9.19's packed backward (SM90) trusts only compact token-major operands: a head-major Q
    (a (T, H, D) view of (H, T, D) memory, what transformers' gpt-oss hands over after its RoPE)
    gets a wrong dQ, and an interleaved one (``qkv.unbind(1)`` of a (T, 3, H, D) tensor, or q
    sliced out of a fused projection: token stride larger than H * D) reads past the end of its
    buffers (CUDA error 700). Both are legal inputs, so both are copied. Under autograd the copy
    is differentiable: the gradient goes back in the caller's layout.
    """
    return t_THD if t_THD.is_contiguous() else t_THD.contiguous()


def shape_bucket(n: int, minimum: int) -> int:
    """Smallest value of the form 2**k or 3 * 2**(k-1) that is >= max(n, minimum).

    Packed batches change their document count and longest document every step; cuDNN graphs
    take them as upper bounds (actual lengths arrive at run time), so rounding them up to about
    two buckets per octave keeps the number of graphs built over a training run small.
    """
    n = max(n, minimum, 1)
    power = 1 << (n - 1).bit_length()  # smallest power of two >= n
    three_quarters = (power // 4) * 3
    return three_quarters if three_quarters >= n else power


# Longest-document and token-count bounds never go below one 64-row tile.
MIN_SEQ_BUCKET = 64


def _power_of_two_at_least(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def backward_rows(*, packed: bool, q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    """``(rows_q, rows_kv)`` a backward graph is sized for: B x S of a dense (B, H, S, D) call, the token buckets of a
    packed (T, H, D) one (which size cuDNN's dQ accumulator: the graph's ``max_total_seq_len``)."""
    if packed:
        return shape_bucket(q.shape[0], MIN_SEQ_BUCKET), shape_bucket(k.shape[0], MIN_SEQ_BUCKET)
    return q.shape[0] * q.shape[2], k.shape[0] * k.shape[2]


def cat_in_memory_order(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``tensors`` concatenated along ``dim`` into one tensor laid out in the memory order of the first (a (B, S, H, D)
    buffer seen as (B, H, S, D) stays one), where a plain ``torch.cat`` would make it contiguous in the dims' order."""
    # Concatenating the tensors permuted to their memory order (outermost dimension first) writes one compact tensor in
    # that order; permuting it back gives the parts' own layout.
    strides = tensors[0].stride()
    order = sorted(range(tensors[0].dim()), key=lambda d: (-strides[d], d))
    whole = torch.cat([t.permute(order) for t in tensors], dim=order.index(dim))
    return whole.permute([order.index(d) for d in range(len(order))])


def split_evenly(t: torch.Tensor, count: int, dim: int) -> tuple[torch.Tensor, ...]:
    """``t`` cut into ``count`` consecutive views along ``dim`` whose sizes are at most one apart, the larger first (the
    cut of ``torch.tensor_split``), under one autograd node: the backward of tensor_split's slices builds a zero-filled
    whole per slice and sums them, which at a grouped gpt-oss call's 4 GB q is several passes over it; split's backward
    is one concatenation."""
    size = t.shape[dim]
    return torch.split(t, [size // count + (i < size % count) for i in range(count)], dim=dim)


def joined_results(parts: list, dim: int) -> tuple:
    """One call's results from its pieces' result tuples (``(out, lse)``, or the provider's ``(dq, dk, dv, dsinks)``):
    each position concatenated along ``dim`` by :func:`cat_in_memory_order`, None where a piece has none (an LSE not
    asked for). Differentiable: each piece's output gets its slice of the gradient."""
    return tuple(
        None if any(t is None or t.numel() == 0 for t in position) else cat_in_memory_order(list(position), dim) for position in zip(*parts)
    )


def packed_bounds(*, documents: int, max_seqlen: int, tokens: int) -> tuple[int, int]:
    """``(batch, seq)`` upper bounds a packed cuDNN graph is built for; a graph is built per distinct pair.

    Recipes pack a fixed token count per step while the document count and the longest document
    change every step. Two buckets per octave of each built about 15 forward/backward graph pairs per
    mask over a run, at about 0.1 s each (7.0 s of an 18 s, 200-step gpt-oss run on an H200), so both
    bounds take one bucket per octave. They stay tight otherwise: a looser longest-document bound
    costs real time, e.g. full causal attention with sinks, 16,384 tokens in 13 documents, forward +
    backward 5.84 ms with the token count as the bound against 2.04 ms with the longest document's
    power of two. No document is longer than the step, so the token count's bucket caps ``seq``. The document bound
    stops at :data:`~cudnn_attention.errata.GRID_LIMIT`, the largest batch cuDNN's kernels run: 40,000 documents get a
    graph for 65,535, not a refused one for 65,536.
    """
    seq = min(_power_of_two_at_least(max(max_seqlen, MIN_SEQ_BUCKET)), shape_bucket(tokens, MIN_SEQ_BUCKET))
    return min(_power_of_two_at_least(documents), max(documents, GRID_LIMIT)), seq


def allocate_forward_outputs(
    q: torch.Tensor, v: torch.Tensor, *, packed: bool, need_lse: bool, out_strides: tuple | None = None, zero_tails: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for a forward call; ``lse`` is ``None`` when not needed.

    Dense: out adopts q's layout (``out_strides``, when the caller already derived them with
    :func:`like_layout_strides`), lse (B, H, S_q). Packed: out (T, H, D_v), lse (T, H).
    Packed tokens a kernel may leave unwritten (past ``cu_seqlens[-1]``, documents with no key)
    start at zero (unless ``zero_tails=False``: the kernel, or a pass after it, writes every row) and lse
    at ``-inf``, so they read as the exact result instead of stale memory; the rows of a padded
    batch are masked after the kernel instead.
    """
    if packed:
        T, H = q.shape[0], q.shape[1]
        out = torch.empty((T, H, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if need_lse else None
        if zero_tails:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        return out, lse
    B, H, S = q.shape[0], q.shape[1], q.shape[2]
    shape = (B, H, S, v.shape[-1])
    # Padded rows are masked after the kernel (launch.run_forward), so no fill here.
    out = torch.empty_strided(shape, out_strides or like_layout_strides(shape, q), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device) if need_lse else None
    return out, lse


def allocate_backward_outputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    packed: bool,
    padded: bool,
    grad_strides: tuple | None = None,
    zero_tails: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``. Dense gradients adopt their input's layout (autograd hands them back as
    ``.grad``); packed ones are contiguous. Packed and padded ones start at zero: tokens outside any
    document, and sequences with no query or no key, get no write from the kernel (packed: unless
    ``zero_tails=False``, when the caller knows the kernel writes every row)."""
    if packed:
        allocate = torch.zeros if zero_tails else torch.empty
        return (
            allocate(q.shape, dtype=q.dtype, device=q.device),
            allocate(k.shape, dtype=q.dtype, device=q.device),
            allocate(v.shape, dtype=q.dtype, device=q.device),
        )
    # grad_strides: the same like_layout_strides, already derived for the graph (a backward's host time counts).
    strides = grad_strides or tuple(like_layout_strides(tuple(t.shape), t) for t in (q, k, v))
    grads = tuple(torch.empty_strided(t.shape, stride, dtype=q.dtype, device=q.device) for t, stride in zip((q, k, v), strides))
    if padded:
        for grad in grads:
            grad.zero_()
    return grads
