"""The rows of packed outputs the kernels leave unwritten, set after them instead of zero-filling whole outputs first.

cuDNN's packed kernels write every row of every document they compute and leave the others as the allocator handed
them: the tokens from ``cu_seqlens[-1]`` on (a capacity tail: a buffer of fixed size holding fewer real tokens) and,
with separate prefix sums for q and kv, the query rows of documents without keys. Zero-filling whole outputs before the
kernels wrote every byte twice: on an H200 at gpt-oss's packed shape the fills of O, the LSE and dQ/dK/dV took about
0.08 ms of a 1.66 ms training step. These passes write only the unwritten rows, after the kernels (so whatever a kernel
may have put there is overwritten too), one launch for up to three of a direction's outputs, with no host sync:

- :func:`fill_past_last_document` reads where the tail starts, ``cu_seqlens[-1]``, on the device (one prefix-sum
  tensor for both sides leaves nothing else unwritten);
- :func:`fill_rows` sets the rows a (T,) mask marks (derived once per batch from both prefix-sum tensors).

With Triton (shipped with CUDA builds of torch) that is one kernel that stores nothing outside those rows; without it
(CPU tensors, installs without Triton) a masked fill in torch ops does the same over the whole tensor.
"""

from __future__ import annotations

import torch

__all__ = ["fill_past_last_document", "fill_rows"]

try:  # Triton comes with CUDA builds of torch; CPU-only installs have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# One launch takes up to this many tensors (a backward's dQ, dK and dV).
_SLOTS = 3
# A program sets BLOCK_T tokens' rows, BLOCK_W elements at a time (small tiles: a large one spills registers). One
# whose tokens are all written by the kernels stores nothing.
_BLOCK_T = 16
_BLOCK_W = 128


def fill_past_last_document(cu_seqlens: torch.Tensor, fills: list[tuple[torch.Tensor, float]]) -> None:
    """Set every row ``t >= cu_seqlens[-1]`` of each tensor in ``fills`` to its value, in place; rows before are
    not touched. Each tensor is token-major ((T, ...), its own T) and contiguous; ``cu_seqlens`` is on its device."""
    _fill([(t, None, value) for t, value in fills], cu_seqlens)


def fill_rows(fills: list[tuple[torch.Tensor, torch.Tensor, float]]) -> None:
    """For each ``(tensor, rows_T, value)`` of ``fills``, set the rows of ``tensor`` where the bool ``rows_T`` (T
    elements, ``(T,)`` or ``(T, 1)``, the tensor's T) is True to ``value``, in place; other rows are not touched. Each
    tensor is token-major and contiguous, its mask on its device."""
    _fill(fills, None)


def _fill(fills: list, cu_seqlens: torch.Tensor | None) -> None:
    """``fills``: ``(tensor, rows_T or None, value)``; None: the rows past ``cu_seqlens[-1]``."""
    fills = [fill for fill in fills if fill[0].numel()]
    if not fills:
        return
    if triton is None or not fills[0][0].is_cuda:
        for t, rows_T, value in fills:
            if rows_T is None:
                rows_T = torch.arange(t.shape[0], device=t.device) >= cu_seqlens[-1]
            t.masked_fill_(rows_T.reshape(-1, *[1] * (t.dim() - 1)), value)
        return
    for start in range(0, len(fills), _SLOTS):
        _launch(fills[start : start + _SLOTS], cu_seqlens)


def _launch(fills: list, cu_seqlens: torch.Tensor | None) -> None:
    count = len(fills)
    fills = fills + fills[-1:] * (_SLOTS - len(fills))  # unused slots: COUNT keeps their programs from running
    by_mask = cu_seqlens is None
    # A mask is read as bytes; a tail launch reads none (any tensor stands in for the pointer).
    args = [a for t, rows_T, value in fills for a in (t, rows_T.view(torch.uint8) if by_mask else t, t.shape[0], value)]
    widths = {f"WIDTH{i}": t.numel() // t.shape[0] for i, (t, _, _) in enumerate(fills)}
    programs = triton.cdiv(max(t.shape[0] for t, _, _ in fills), _BLOCK_T)
    _fill_rows_kernel[(programs, count)](
        fills[0][0] if by_mask else cu_seqlens,
        0 if by_mask else cu_seqlens.numel() - 1,
        *args,
        **widths,
        COUNT=count,
        BY_MASK=by_mask,
        BLOCK_T=_BLOCK_T,
        BLOCK_W=_BLOCK_W,
    )


if triton is not None:

    @triton.jit
    def _fill_where(
        ptr, rows_ptr, first_token, tokens, value, WIDTH: tl.constexpr, BY_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr
    ):
        # This program's tokens of a (tokens, WIDTH) contiguous tensor, where its mask is set or they lie in
        # [first_token, tokens).
        t_T1 = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        inside_T1 = t_T1 < tokens
        if BY_MASK:
            chosen_T1 = inside_T1 & (tl.load(rows_ptr + t_T1, mask=inside_T1, other=0) != 0)
        else:
            chosen_T1 = inside_T1 & (t_T1 >= first_token)
        row_T1 = t_T1.to(tl.int64) * WIDTH
        values_TW = (tl.zeros((BLOCK_T, BLOCK_W), dtype=tl.float32) + value).to(ptr.dtype.element_ty)
        for w in range(0, WIDTH, BLOCK_W):
            w_1W = w + tl.arange(0, BLOCK_W)[None, :]
            tl.store(ptr + row_T1 + w_1W, values_TW, mask=chosen_T1 & (w_1W < WIDTH))

    # Token counts change from batch to batch and are never specialized; a row's width (heads x head dim) is a
    # model's constant, so a model compiles one kernel per direction and kind of pass.
    @triton.jit(do_not_specialize=["last", "tokens0", "tokens1", "tokens2"])
    def _fill_rows_kernel(
        cu_ptr,
        last,
        ptr0,
        rows0,
        tokens0,
        value0,
        ptr1,
        rows1,
        tokens1,
        value1,
        ptr2,
        rows2,
        tokens2,
        value2,
        WIDTH0: tl.constexpr,
        WIDTH1: tl.constexpr,
        WIDTH2: tl.constexpr,
        COUNT: tl.constexpr,
        BY_MASK: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        first_token = 0
        if not BY_MASK:
            first_token = tl.load(cu_ptr + last)
        which = tl.program_id(1)
        if which == 0:
            _fill_where(ptr0, rows0, first_token, tokens0, value0, WIDTH0, BY_MASK, BLOCK_T, BLOCK_W)
        if COUNT > 1:
            if which == 1:
                _fill_where(ptr1, rows1, first_token, tokens1, value1, WIDTH1, BY_MASK, BLOCK_T, BLOCK_W)
        if COUNT > 2:
            if which == 2:
                _fill_where(ptr2, rows2, first_token, tokens2, value2, WIDTH2, BY_MASK, BLOCK_T, BLOCK_W)
