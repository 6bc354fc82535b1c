"""The rows of packed outputs past the last document, set after the kernels without reading where they start.

When both sides of a packed call share one prefix-sum tensor ``cu``, cuDNN writes every row that lies in a
document; only the tokens from ``cu[-1]`` on (a capacity tail: a buffer of fixed size holding fewer real tokens)
are left as the allocator handed them. Zero-filling whole outputs before the kernels wrote every byte twice: on an
H200 at gpt-oss's packed shape the fills of O, the LSE and dQ/dK/dV took about 0.08 ms of a 1.66 ms training step.
:func:`fill_past_last_document` writes the tail alone, after the kernels (so whatever a kernel may have put there
is overwritten too), reading ``cu[-1]`` on the device: one launch for all of a direction's outputs, no host sync.

With Triton (shipped with CUDA builds of torch) that is one kernel that skips the rows before the tail; without it
(CPU tensors, installs without Triton) a masked fill in torch ops does the same over the whole tensor.
"""

from __future__ import annotations

import torch

__all__ = ["fill_past_last_document"]

try:  # Triton comes with CUDA builds of torch; CPU-only installs have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# One launch takes up to this many tensors (a backward's dQ, dK and dV).
_SLOTS = 3
# A program sets BLOCK_T tokens' rows, BLOCK_W elements at a time (small tiles: a large one spills registers). One
# whose tokens lie before the tail stores nothing.
_BLOCK_T = 16
_BLOCK_W = 128


def fill_past_last_document(cu_seqlens: torch.Tensor, fills: list[tuple[torch.Tensor, float]]) -> None:
    """Set every row ``t >= cu_seqlens[-1]`` of each tensor in ``fills`` to its value, in place; rows before are
    not touched. Each tensor is token-major ((T, ...), its own T) and contiguous; ``cu_seqlens`` is on its device."""
    fills = [(t, value) for t, value in fills if t.numel()]
    if not fills:
        return
    if triton is None or not cu_seqlens.is_cuda:
        for t, value in fills:
            tail_T = torch.arange(t.shape[0], device=t.device) >= cu_seqlens[-1]
            t.masked_fill_(tail_T.view(-1, *[1] * (t.dim() - 1)), value)
        return
    for start in range(0, len(fills), _SLOTS):
        _launch(cu_seqlens, fills[start : start + _SLOTS])


def _launch(cu_seqlens: torch.Tensor, fills: list[tuple[torch.Tensor, float]]) -> None:
    count = len(fills)
    fills = fills + fills[-1:] * (_SLOTS - len(fills))  # unused slots: COUNT keeps their programs from running
    args = [a for t, value in fills for a in (t, t.shape[0], value)]
    widths = {f"WIDTH{i}": t.numel() // t.shape[0] for i, (t, _) in enumerate(fills)}
    programs = triton.cdiv(max(t.shape[0] for t, _ in fills), _BLOCK_T)
    _fill_tails_kernel[(programs, count)](
        cu_seqlens, cu_seqlens.numel() - 1, *args, **widths, COUNT=count, BLOCK_T=_BLOCK_T, BLOCK_W=_BLOCK_W
    )


if triton is not None:

    @triton.jit
    def _fill_rows(ptr, first_token, tokens, value, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
        # This program's tokens of a (tokens, WIDTH) contiguous tensor, where they lie in [first_token, tokens).
        t_T1 = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        tail_T1 = (t_T1 >= first_token) & (t_T1 < tokens)
        row_T1 = t_T1.to(tl.int64) * WIDTH
        values_TW = (tl.zeros((BLOCK_T, BLOCK_W), dtype=tl.float32) + value).to(ptr.dtype.element_ty)
        for w in range(0, WIDTH, BLOCK_W):
            w_1W = w + tl.arange(0, BLOCK_W)[None, :]
            tl.store(ptr + row_T1 + w_1W, values_TW, mask=tail_T1 & (w_1W < WIDTH))

    # Token counts change from batch to batch and are never specialized; a row's width (heads x head dim) is a
    # model's constant, so a model compiles one kernel per direction.
    @triton.jit(do_not_specialize=["last", "tokens0", "tokens1", "tokens2"])
    def _fill_tails_kernel(
        cu_ptr,
        last,
        ptr0,
        tokens0,
        value0,
        ptr1,
        tokens1,
        value1,
        ptr2,
        tokens2,
        value2,
        WIDTH0: tl.constexpr,
        WIDTH1: tl.constexpr,
        WIDTH2: tl.constexpr,
        COUNT: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        first_token = tl.load(cu_ptr + last)
        which = tl.program_id(1)
        if which == 0:
            _fill_rows(ptr0, first_token, tokens0, value0, WIDTH0, BLOCK_T, BLOCK_W)
        if COUNT > 1:
            if which == 1:
                _fill_rows(ptr1, first_token, tokens1, value1, WIDTH1, BLOCK_T, BLOCK_W)
        if COUNT > 2:
            if which == 2:
                _fill_rows(ptr2, first_token, tokens2, value2, WIDTH2, BLOCK_T, BLOCK_W)
