"""Input checks that run before any kernel: each error names the offending value.

Checks that would read device memory back to the host (cu_seqlens monotone, lengths in range)
run only when the caller asks with ``validate=True``.
"""

from __future__ import annotations

import math

import torch

from . import _compat
from .policy import note_copy

__all__ = [
    "check_cu_seqlens",
    "check_flag",
    "check_prefix_sums",
    "check_qkv",
    "check_seqlens",
    "check_sinks",
    "nothing_to_compute",
    "positive_scale",
    "resolve_scale",
    "validate_cu_seqlens",
    "validate_seqlens",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _require_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _innermost_dense(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        # The kernels read the head dim as one contiguous vector. Said once per name: a loop passing the same
        # layout would hear it on every call. Not while torch.compile traces: the graph holds the copy.
        if not torch.compiler.is_compiling():
            message = f"cudnn_attention: {name} has innermost stride {t.stride(-1)} (shape {tuple(t.shape)}); copying it contiguous"
            note_copy(name, message + " on each such call (said once per input)")
        return t.contiguous()
    return t


def check_flag(value, name: str) -> bool:
    """``value`` when it is a bool (Python's, numpy's, or torch's symbolic one while compiling); anything else raises
    ``TypeError`` naming it: its truth would decide silently (``causal="false"`` reads as true)."""
    if type(value) is bool or isinstance(value, torch.SymBool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def check_qkv(q, k, v, *, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check ranks, dtypes, devices and shapes of q/k/v; return them with a dense head dim.

    Dense: (B, H_q, S_q, D), (B, H_kv, S_kv, D), (B, H_kv, S_kv, D_v). Packed: (T_q, H_q, D),
    (T_kv, H_kv, D), (T_kv, H_kv, D_v). H_q must be a multiple of H_kv (GQA/MQA).
    """
    # Written as plain comparisons: this runs on every call, and messages are built only on failure.
    rank, layout = (3, "(T, H, D)") if packed else (4, "(B, H, S, D)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if not packed and not (q_shape[0] == k_shape[0] == v_shape[0]):
        raise ValueError(f"batch sizes differ: q {q_shape[0]}, k {k_shape[0]}, v {v_shape[0]}")
    seq_axis = 0 if packed else 2
    if k_shape[seq_axis] != v_shape[seq_axis]:
        raise ValueError(f"k and v must have the same number of keys, got k {tuple(k_shape)} and v {tuple(v_shape)}")
    if k_shape[1] != v_shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got {k_shape[1]} and {v_shape[1]}")
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q_shape[-1]} and {k_shape[-1]}")
    if q_shape[-1] == 0 or v_shape[-1] == 0:
        raise ValueError(f"the head dim must be >= 1, got q/k head dim {q_shape[-1]} and v head dim {v_shape[-1]}")
    if k_shape[1] == 0 or q_shape[1] % k_shape[1]:
        raise ValueError(f"query heads ({q_shape[1]}) must be a multiple of key/value heads ({k_shape[1]})")
    return _innermost_dense(q, "q"), _innermost_dense(k, "k"), _innermost_dense(v, "v")


def resolve_scale(scale, head_dim: int, *, name: str = "scale") -> float:
    """``scale`` as a float, defaulting to ``1 / sqrt(head_dim)``; errors call it ``name``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {scale!r} ({type(scale).__name__})")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def nothing_to_compute(q: torch.Tensor, k: torch.Tensor, *, max_seqlen_q: int | None = None, max_seqlen_kv: int | None = None) -> bool:
    """Whether the call has no work: an empty q or k, or (packed) every document of one side empty.
    The exact path then returns the empty or zero result without a kernel; it is not a fallback."""
    return q.numel() == 0 or k.numel() == 0 or max_seqlen_q == 0 or max_seqlen_kv == 0


def positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """``(q', scale')`` with ``scale' > 0`` and the same attention: ``softmax(scale * q k^T)``.

    cuDNN's kernels mask with ``-inf`` and subtract the row maximum before scaling, so ``scale = 0``
    gives ``0 * -inf = NaN`` and a negative scale overflows. Both are exact with a positive scale:
    ``-s * q k^T = s * (-q) k^T``, and ``0 * q k^T = 1 * (0 q) k^T`` (uniform weights). Both
    folds are differentiable, so dQ comes back negated, or zero, as it must.
    """
    if scale > 0:
        return q, scale
    if scale == 0:
        return q * 0, 1.0
    return -q, -scale


def check_sinks(sinks, q: torch.Tensor, heads: int) -> torch.Tensor | None:
    """Per-query-head sink logits: a floating (H_q,) tensor on q's device."""
    if sinks is None:
        return None
    _require_tensor(sinks, "sinks")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ValueError(f"sinks must have shape ({heads},) (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on {q.device}, got {sinks.device}")
    return sinks


def check_seqlens(seqlens, name: str, batch: int, device: torch.device) -> torch.Tensor | None:
    """Valid lengths of a right-padded dense batch: an integer (B,) tensor on the inputs' device."""
    if seqlens is None:
        return None
    _require_tensor(seqlens, name)
    if seqlens.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {seqlens.dtype}")
    if seqlens.dim() != 1 or seqlens.shape[0] != batch:
        raise ValueError(f"{name} must have shape ({batch},) (one length per batch row), got {tuple(seqlens.shape)}")
    if seqlens.device != device:
        raise ValueError(f"{name} must be on {device}, got {seqlens.device}")
    return seqlens


def check_cu_seqlens(
    cu_seqlens_q,
    cu_seqlens_kv,
    max_seqlen_q,
    max_seqlen_kv,
    device: torch.device,
    *,
    total_q: int,
    total_kv: int,
    names: tuple[str, str, str, str] = ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"),
) -> tuple[int, int]:
    """Prefix sums: 1-D int32/int64 tensors of equal length B + 1 >= 2 on ``device``; maxima non-negative Python ints
    (0 when every document of that side is empty). All of it is host metadata, so it is checked on every device, with
    the argument named as the caller calls it (``names``: the two prefix sums, then the two maxima).

    Returns the maxima clamped to their side's token count T, which every call uses from here on (the graphs are keyed
    by it). A maximum is an upper bound, as in FlashAttention: a static ``max_seqlen=4096`` for a 20-token batch (CUDA
    graphs and ``torch.compile`` users pass one) means the same as 20, since no document is longer than all the tokens.
    Unclamped, it would not be harmless: the device-side check compares it in the prefix sums' int32 (2**40 wraps to
    0, a false alarm that stops the process), and the exact path allocates memory in proportion to it. A maximum below
    the longest document is an error the prefix-sum check reports (:func:`check_prefix_sums`)."""
    for name, cu in zip(names[:2], (cu_seqlens_q, cu_seqlens_kv)):
        _require_tensor(cu, name)
        if cu.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with B + 1 >= 2 entries, got shape {tuple(cu.shape)}")
        if cu.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {cu.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_kv.shape[0]:
        batches = (cu_seqlens_q.shape[0] - 1, cu_seqlens_kv.shape[0] - 1)
        raise ValueError(f"{names[0]} and {names[1]} describe different batch sizes: {batches[0]} and {batches[1]}")
    for name, value, total in ((names[2], max_seqlen_q, total_q), (names[3], max_seqlen_kv, total_kv)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be a Python int, got {value!r} ({type(value).__name__})")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return min(max_seqlen_q, total_q), min(max_seqlen_kv, total_kv)


def check_prefix_sums(
    cu_seqlens_q,
    cu_seqlens_kv,
    total_q: int,
    total_kv: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    validate: bool,
    names: tuple[str, str, str, str] = ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"),
    cover_all: bool = False,
) -> bool:
    """Prefix sums start at 0, never decrease, end within T (exactly at T with ``cover_all``: every
    token is real, as in a transformers batch) and hold no document longer than ``max_seqlen``.
    Returns whether a check ran (or is queued): False where none can (meta tensors, CUDA tensors while
    compiling or capturing a CUDA graph).

    Bad ones would make the kernels read past q/k/v, silently truncate documents, or leave real
    tokens in no document. On the host (``validate=True``, or CPU tensors, where it costs no device
    sync) a violation raises a ValueError naming the argument (``names``: the two prefix sums, then
    the two maxima, as the caller calls them) and the value. CUDA tensors are otherwise checked on
    the device: the check is queued on the stream ahead of the kernels, and a violation is a
    device-side assertion that stops the process before any attention kernel reads the bad offsets.
    A batch asks for it once per bounds (:class:`cudnn_attention.packed_batch.PackedBatch`, which every
    layer of a forward shares), and not while compiling or capturing a CUDA graph (validate the batch
    where it is built, or pass ``validate=True`` once). A compiled graph cannot branch on CPU tensors'
    values either, so under ``torch.compile`` CPU prefix sums get the same assertion, in the graph, on
    every call (a ``RuntimeError`` when it runs); ``validate=True`` reads them on the host, which a graph
    with ``fullgraph=True`` cannot do.
    """
    if cu_seqlens_q.device.type == "meta":
        return False  # no values to check, and none computed from them (a meta call only propagates shapes)
    compiling = torch.compiler.is_compiling()
    if validate or not (cu_seqlens_q.is_cuda or compiling):
        validate_cu_seqlens(cu_seqlens_q, names[0], total_q, max_seqlen_q, max_name=names[2], cover_all=cover_all)
        validate_cu_seqlens(cu_seqlens_kv, names[1], total_kv, max_seqlen_kv, max_name=names[3], cover_all=cover_all)
        return True
    if compiling:
        if not cu_seqlens_q.is_cuda:  # checked per call, as eager checks CPU tensors
            _assert_prefix_sums(cu_seqlens_q, cu_seqlens_kv, total_q, total_kv, max_seqlen_q, max_seqlen_kv, names, cover_all)
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    _assert_prefix_sums(cu_seqlens_q, cu_seqlens_kv, total_q, total_kv, max_seqlen_q, max_seqlen_kv, names, cover_all)
    return True


def _assert_prefix_sums(cu_seqlens_q, cu_seqlens_kv, total_q, total_kv, max_seqlen_q, max_seqlen_kv, names, cover_all: bool) -> None:
    """Queue :func:`check_prefix_sums`' conditions as one device-side assertion (no host read)."""
    ok = None
    for cu, total, max_seqlen in ((cu_seqlens_q, total_q, max_seqlen_q), (cu_seqlens_kv, total_kv, max_seqlen_kv)):
        lengths = cu[1:] - cu[:-1]
        ends_ok = (cu[-1] == total) if cover_all else (cu[-1] <= total)
        side_ok = (cu[0] == 0) & (lengths.min() >= 0) & ends_ok & (lengths.max() <= max_seqlen)
        ok = side_ok if ok is None else ok & side_ok
    _compat.assert_on_device(
        ok,
        f"cudnn_attention: invalid {names[0]}/{names[1]}: they must start at 0, never decrease, end "
        f"{'at' if cover_all else 'within'} the token count, and hold no document longer than {names[2]}/{names[3]}",
    )


def validate_cu_seqlens(
    cu_seqlens, name: str, total: int, max_seqlen: int, *, max_name: str = "max_seqlen", cover_all: bool = False
) -> None:
    """Host-side checks (they synchronize): starts at 0, non-decreasing, ends <= T (== T with
    ``cover_all``), lengths <= ``max_seqlen`` (called ``max_name`` in the message)."""
    cu = cu_seqlens.detach().cpu().long()
    lengths = cu[1:] - cu[:-1]
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0].item()}")
    if (lengths < 0).any():
        bad = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"{name} must be non-decreasing, but entry {bad + 1} ({cu[bad + 1].item()}) < entry {bad} ({cu[bad].item()})")
    if cu[-1] > total:
        raise ValueError(f"{name}[-1] = {cu[-1].item()} exceeds the {total} packed tokens")
    if cover_all and cu[-1] < total:
        raise ValueError(f"{name}[-1] = {cu[-1].item()} leaves tokens {cu[-1].item()}..{total - 1} of the {total} in no document")
    if lengths.max() > max_seqlen:
        raise ValueError(f"a document in {name} has {lengths.max().item()} tokens, more than {max_name} {max_seqlen}")


def validate_seqlens(seqlens, name: str, limit: int) -> None:
    """Host-side check (it synchronizes): every length in [0, limit]."""
    lengths = seqlens.detach().cpu()
    if (lengths < 0).any() or (lengths > limit).any():
        raise ValueError(f"{name} must lie in [0, {limit}], got {lengths.tolist()}")
