"""The two elementwise passes learnable sinks add around the sink-less cuDNN kernels, fused.

Forward (:func:`fold_sinks`): with ``lse`` the sink-less log-sum-exp, the sink forward is exactly
``out * sigmoid(lse - sink)`` with ``lse' = logaddexp(lse, sink)``. Backward (:func:`sink_gradient`):
``dSink_h = -sum_rows exp(sink_h - lse'_row) * rowsum(dO * O)_row``, in float32 end to end.

Written with torch ops each is several passes over the output (casts, a broadcast multiply that
cannot vectorize, float32 temporaries): on an H200 at gpt-oss's shape the fold cost 0.31 ms and the
gradient 0.76 ms against a 0.37 ms forward kernel. With Triton (shipped with CUDA builds of torch)
each is one read (and, for the fold, one write) of the output. The torch-op versions serve CPU
tensors and machines without Triton, and define the semantics the fused kernels are tested against.
"""

from __future__ import annotations

import torch

__all__ = ["fold_sinks", "sink_gradient"]

try:  # Triton comes with CUDA builds of torch; CPU-only installs have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, absent: torch.Tensor | None = None) -> None:
    """Turn a sink-less ``(out, lse)`` into the sink forward's, in place: each sink adds
    ``exp(sink_h)`` to its head's denominator, so ``lse' = logaddexp(lse, sink)`` and
    ``out' = out * exp(lse - lse') = out * sigmoid(lse - sink)``. A row whose mask leaves it no key
    (``lse = -inf``) sees the sink alone: zero output, ``lse' = sink``. Rows flagged in ``absent``
    (bool, broadcastable to ``lse``: padding, capacity tails, documents without keys) see no sink:
    zero output and ``-inf``, whatever the sink and whatever ``out`` and ``lse`` held there (the
    kernel leaves them unwritten, so they need no fill beforehand). A NaN sink gives NaN rows, as in torch.

    ``out`` is (B, H, S, D) or (T, H, D) with a unit innermost stride; ``lse`` (B, H, S) or (T, H),
    contiguous float32; ``sinks`` (H,) float32.
    """
    if _fused(out, lse):
        _launch_fold(out, lse, sinks, absent)
        return
    sinks_view = sinks.view(1, -1, 1) if lse.dim() == 3 else sinks.view(1, -1)
    folded_out = out.float() * torch.sigmoid(lse - sinks_view).unsqueeze(-1)
    folded = torch.logaddexp(lse, sinks_view)
    if absent is not None:
        folded_out.masked_fill_(absent.unsqueeze(-1), 0.0)
        folded.masked_fill_(absent, float("-inf"))
    out.copy_(folded_out)
    lse.copy_(folded)


def sink_gradient(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """dSink (H,) float32 from the sink-inclusive LSE; rows with ``lse = -inf`` (padding) contribute
    nothing. ``grad_out`` has ``out``'s strides. Deterministic: per-row terms, then one ordered sum."""
    if _fused(out, lse):
        return _launch_sink_gradient(grad_out, out, lse, sinks)
    row_dot = (grad_out.float() * out.float()).sum(-1)  # (B, H, S) or (T, H)
    sinks_view = sinks.view(1, -1, 1) if lse.dim() == 3 else sinks.view(1, -1)
    weight = torch.exp(sinks_view - lse).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    reduce_dims = (0, 2) if lse.dim() == 3 else (0,)
    return -(weight * row_dot).sum(reduce_dims)


def _fused(out: torch.Tensor, lse: torch.Tensor) -> bool:
    return triton is not None and out.is_cuda and out.stride(-1) == 1 and out.shape[-1] <= 256 and lse.is_contiguous()


# ----------------------------------------------------------------------------------------------
# Triton kernels. Rows are indexed like ``lse`` (contiguous): dense (B, H, S) -> (A=B, H, C=S),
# packed (T, H) -> (A=T, H, C=1); ``out``/``grad_out`` are addressed through their own strides.
# ----------------------------------------------------------------------------------------------


def _row_geometry(out: torch.Tensor):
    if out.dim() == 4:
        B, H, S, D = out.shape
        return B, H, S, D, out.stride(0), out.stride(1), out.stride(2)
    T, H, D = out.shape
    return T, H, 1, D, out.stride(0), out.stride(1), 0


def _wide(geometry: tuple) -> bool:
    """Whether the largest element offset of an output of this :func:`_row_geometry` (and of ``grad_out``, which has its
    strides) passes int32, the type Triton computes the kernels' offsets in unless told otherwise: an output of 2**31
    elements or more (gpt-oss's 64 heads x 64 at 524,288 packed tokens), where int32 offsets wrap and the kernels would
    read and write outside the tensor."""
    A, H, C, D, sa, sh, sc = geometry
    return (A - 1) * sa + (H - 1) * sh + (C - 1) * sc + D - 1 >= 2**31


def _blocks(D: int, rows: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(4096 // block_d, triton.next_power_of_2(max(rows, 1))))
    return block_r, block_d


def _launch_fold(out, lse, sinks, absent):
    A, H, C, D, sa, sh, sc = geometry = _row_geometry(out)
    rows = A * H * C
    if rows == 0:
        return
    if absent is None:
        absent_AC, has_absent = lse, False  # never read
    else:
        # absent broadcasts over heads: (B, 1, S) -> (A, C) or (T, 1) -> (A, 1); made contiguous (small).
        absent_AC, has_absent = (
            absent.expand(A, 1, C).reshape(A, C).contiguous() if lse.dim() == 3 else absent.reshape(A, 1).contiguous(),
            True,
        )
    block_r, block_d = _blocks(D, rows)
    _fold_kernel[(triton.cdiv(rows, block_r),)](
        out, lse, sinks, absent_AC, rows, H, C, sa, sh, sc, D, HAS_ABSENT=has_absent, WIDE=_wide(geometry), BLOCK_R=block_r, BLOCK_D=block_d
    )


def _launch_sink_gradient(grad_out, out, lse, sinks):
    A, H, C, D, sa, sh, sc = geometry = _row_geometry(out)
    rows = A * H * C
    terms = torch.empty(lse.shape, dtype=torch.float32, device=out.device)
    if rows:
        block_r, block_d = _blocks(D, rows)
        _sink_gradient_kernel[(triton.cdiv(rows, block_r),)](
            grad_out, out, lse, sinks, terms, rows, H, C, sa, sh, sc, D, WIDE=_wide(geometry), BLOCK_R=block_r, BLOCK_D=block_d
        )
    return terms.sum((0, 2)) if lse.dim() == 3 else terms.sum(0)


if triton is not None:
    # Every per-row value is a (BLOCK_R, 1) tensor in the tile's own layout, never a 1-D vector broadcast against
    # the (BLOCK_R, BLOCK_D) tile afterwards, and the fold writes the LSE back after O. The earlier kernels (a
    # loaded 1-D vector broadcast into the tile, the LSE stored in place before O was read) compiled with Triton
    # 3.6 (torch 2.11's) into code that scaled a few random rows per launch by another row's factor (on an H200:
    # 1,003 of 306,304 rows over 30 folds at D 192, max error 1.8; at D 64 two rows), with results that differed
    # from launch to launch. Both changes were made together, so which one the compiler mishandled is not known;
    # the layout one is the likelier (its broadcast goes through a shared-memory layout conversion).
    # Redundant stores of a (BLOCK_R, 1) value write the same bits.

    @triton.jit
    def _row_offsets(a_R1, h_R1, c_R1, sa, sh, sc, WIDE: tl.constexpr):
        # int64 only where int32 would wrap (WIDE, resolved at compile time): the narrow kernels stay as measured.
        if WIDE:
            a_R1 = a_R1.to(tl.int64)
            h_R1 = h_R1.to(tl.int64)
            c_R1 = c_R1.to(tl.int64)
        return a_R1 * sa + h_R1 * sh + c_R1 * sc

    @triton.jit
    def _fold_kernel(
        out_ptr,
        lse_ptr,
        sinks_ptr,
        absent_ptr,
        rows,
        H,
        C,
        sa,
        sh,
        sc,
        D,
        HAS_ABSENT: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        r_R1 = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        valid_R1 = r_R1 < rows
        c_R1 = r_R1 % C
        h_R1 = (r_R1 // C) % H
        a_R1 = r_R1 // (C * H)
        lse_R1 = tl.load(lse_ptr + r_R1, mask=valid_R1, other=0.0)
        sink_R1 = tl.load(sinks_ptr + h_R1, mask=valid_R1, other=0.0)
        factor_R1 = tl.sigmoid(lse_R1 - sink_R1)
        # logaddexp as torch computes it: -inf when both are -inf, NaN when the sink is NaN.
        high_R1 = tl.where(lse_R1 > sink_R1, lse_R1, sink_R1)
        folded_R1 = tl.where(high_R1 == float("-inf"), high_R1, high_R1 + tl.log(tl.exp(lse_R1 - high_R1) + tl.exp(sink_R1 - high_R1)))
        if HAS_ABSENT:
            gone_R1 = tl.load(absent_ptr + a_R1 * C + c_R1, mask=valid_R1, other=0) != 0
            folded_R1 = tl.where(gone_R1, float("-inf"), folded_R1)
        d_1D = tl.arange(0, BLOCK_D)[None, :]
        offsets_RD = _row_offsets(a_R1, h_R1, c_R1, sa, sh, sc, WIDE) + d_1D
        inside_RD = valid_R1 & (d_1D < D)
        values_RD = tl.load(out_ptr + offsets_RD, mask=inside_RD, other=0.0).to(tl.float32) * factor_R1
        if HAS_ABSENT:
            values_RD = tl.where(gone_R1, 0.0, values_RD)  # whatever an unwritten row holds
        tl.store(out_ptr + offsets_RD, values_RD.to(out_ptr.dtype.element_ty), mask=inside_RD)
        tl.store(lse_ptr + r_R1, folded_R1, mask=valid_R1)

    @triton.jit
    def _sink_gradient_kernel(
        grad_ptr,
        out_ptr,
        lse_ptr,
        sinks_ptr,
        terms_ptr,
        rows,
        H,
        C,
        sa,
        sh,
        sc,
        D,
        WIDE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        r_R1 = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        valid_R1 = r_R1 < rows
        c_R1 = r_R1 % C
        h_R1 = (r_R1 // C) % H
        a_R1 = r_R1 // (C * H)
        d_1D = tl.arange(0, BLOCK_D)[None, :]
        offsets_RD = _row_offsets(a_R1, h_R1, c_R1, sa, sh, sc, WIDE) + d_1D
        inside_RD = valid_R1 & (d_1D < D)
        grad_RD = tl.load(grad_ptr + offsets_RD, mask=inside_RD, other=0.0).to(tl.float32)
        values_RD = tl.load(out_ptr + offsets_RD, mask=inside_RD, other=0.0).to(tl.float32)
        row_dot_R1 = tl.sum(grad_RD * values_RD, axis=1, keep_dims=True)
        lse_R1 = tl.load(lse_ptr + r_R1, mask=valid_R1, other=float("-inf"))
        sink_R1 = tl.load(sinks_ptr + h_R1, mask=valid_R1, other=0.0)
        weight_R1 = tl.exp(sink_R1 - lse_R1)
        weight_R1 = tl.where((weight_R1 == weight_R1) & (weight_R1 != float("inf")), weight_R1, 0.0)  # nan_to_num(nan=0, posinf=0)
        tl.store(terms_ptr + r_R1, -weight_R1 * row_dot_R1, mask=valid_R1)
