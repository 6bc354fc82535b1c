"""What a launch passes beside q/k/v: each operand 16-byte aligned, and the index operands derived on the device from a
call's lengths (a padded batch's lengths, full ones for an erratum's reroute, a packed batch's lengths and ragged
offsets), with the masks of rows the kernels leave as they found them. Nothing here reads a device value on the host.
Legend: B batch, S sequence, T tokens.
"""

from __future__ import annotations

import torch

from .call import Lengths
from .policy import note_copy

__all__ = ["absent_rows", "aligned", "full_lengths", "length_operands", "packed_absent_rows", "padding_rows", "ragged_operands"]


def aligned(t: torch.Tensor, name: str) -> torch.Tensor:
    # cuDNN descriptors need a 16-byte aligned base; equal strides with an odd offset would fault.
    if t.data_ptr() % 16:
        note_copy(f"{name} (alignment)", f"cudnn_attention: copying {name} to a 16-byte aligned buffer on each such call (said once)")
        return torch.empty_like(t).copy_(t)
    return t


def length_operands(graph, lengths: Lengths, device: torch.device) -> list:
    """Per-batch lengths and ragged offsets, computed on the device (no host reads). Packed: about
    ten small kernels, so they are kept in the batch (:meth:`~cudnn_attention.packed_batch.PackedBatch.derived`):
    every layer of a forward and every backward of the same batch reuses them. An unpadded dense call whose graph has a
    padding mask (an erratum's reroute) passes full lengths."""
    batch = lengths.batch
    if batch is None:
        if lengths.seqlens_q is None:
            return [] if graph.full_lengths is None else full_lengths(graph.full_lengths, device)
        return [aligned(lengths.seqlens_q, "seqlens_q"), aligned(lengths.seqlens_kv, "seqlens_kv")]
    return batch.derived(
        ("ragged operands", graph.batch, graph.ragged_columns), lambda: ragged_operands(graph, batch.cu_seqlens_q, batch.cu_seqlens_kv)
    )


# (device, B, S_q, S_kv) -> [lengths_q, lengths_kv]: every length full, for an unpadded call whose graph has a padding
# mask (an erratum's reroute, see graph_spec._around_errata). Made once, outside any CUDA graph capture.
_full_length_operands: dict = {}


def full_lengths(shape: tuple, device: torch.device) -> list:
    key = (device, *shape)
    operands = _full_length_operands.get(key)
    if operands is None:
        B, S_q, S_kv = shape
        operands = [torch.full((B,), S_q, dtype=torch.int32, device=device), torch.full((B,), S_kv, dtype=torch.int32, device=device)]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return operands  # from the capture's pool: not to be kept past it
        _full_length_operands[key] = operands
    return operands


def ragged_operands(graph, cu_seqlens_q, cu_seqlens_kv) -> list:
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


def padding_rows(seqlens_q, s_q: int) -> torch.Tensor:
    """(B, 1, S_q, 1) bool: query rows past their sequence's length. cuDNN 9.19 writes rows of a
    sequence whose query length is 0 when S_q is small (seen at S_q = 1), and leaves other padded
    rows unwritten, so padded outputs, incoming gradients and dQ are masked with it rather than
    trusted to the kernel (``masked_fill``, not a product: unwritten memory may hold NaN)."""
    return (torch.arange(s_q, device=seqlens_q.device) >= seqlens_q.view(-1, 1)).view(-1, 1, s_q, 1)


def packed_absent_rows(cu_seqlens_rows, cu_seqlens_other, tokens: int) -> torch.Tensor:
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


def absent_rows(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(absent_q, absent_kv)``, (T, 1) bool each (:func:`packed_absent_rows` of either side), derived together once per
    batch: at its first call (a forward, where memory is low), not at the first backward, whose peak the temporaries of
    the derivation would raise."""
    cu_q, cu_kv = batch.cu_seqlens_q, batch.cu_seqlens_kv
    return batch.derived(
        ("absent rows",),
        lambda: (packed_absent_rows(cu_q, cu_kv, batch.tokens_q), packed_absent_rows(cu_kv, cu_q, batch.tokens_kv)),
    )
