"""Which keys each query may see: the FlashAttention window convention and its cuDNN translation.

Legend: ``i`` is a query row, ``j`` a key column, both counted from the start of their sequence.
With ``window_size=(left, right)`` query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``
(``-1`` leaves that side unbounded). ``causal=True`` is ``right = 0``. With ``bottom_right=True``
the diagonal is anchored at the last query/key pair, i.e. ``i`` is shifted by ``len_kv - len_q``
(per sequence), which is what a decode step with a KV cache needs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["MaskSpec", "effective_lengths", "is_int_window", "make_mask_spec", "visible_keys"]


# The ops' argument for each MaskSpec field (see MaskSpec.OP_SCHEMA).
_OP_FIELDS = (("window_left", "left"), ("window_right", "right"), ("bottom_right", "bottom_right"))


class MaskSpec(NamedTuple):
    """A normalized mask: ``left``/``right`` in FlashAttention's convention (-1 = unbounded), and the diagonal's alignment.
    A NamedTuple: it is part of every graph-cache key, and hashing a tuple costs nothing in Python.

    Everything a mask means lives here, so a new kind of mask is a change to this class (and to the tests' independent
    reference), not to the layers it crosses: its arguments in the ops' flat form (:data:`OP_SCHEMA`, :meth:`op_args`,
    :meth:`from_op_args`), its cuDNN translation (:meth:`cudnn_diagonal`), which keys a row sees (:func:`visible_keys`),
    how many pairs that is (:meth:`visible_pairs`, the FLOP formulas' count) and the rule the packed row passes rely on
    (:attr:`keeps_diagonal`).
    """

    left: int = -1
    right: int = -1
    bottom_right: bool = False

    # The ops' arguments that carry a mask (see cudnn_attention.op_args.OP_TAIL_SCHEMA): its fields, by these names.
    OP_SCHEMA = "int window_left=-1, int window_right=-1, bool bottom_right=False"
    OP_FIELDS = dict(_OP_FIELDS)  # op argument -> field

    @property
    def has_band(self) -> bool:
        return self.left >= 0 or self.right >= 0

    @property
    def keeps_diagonal(self) -> bool:
        """Whether every query row of a sequence with equal query and key lengths sees its own diagonal key. Then one
        prefix-sum tensor for both sides that covers every token leaves the packed kernels no row to skip: every
        document with queries has keys, and every key is seen by its own query (:mod:`cudnn_attention.packed_rows`
        relies on it). True of every band, since both bounds are -1 or >= 0."""
        return self.left >= -1 and self.right >= -1

    def op_args(self) -> dict:
        """The mask as the ops take it (:data:`OP_SCHEMA`)."""
        # The module's tuple, not the class's dict: torch 2.9's Dynamo cannot trace a method of a NamedTuple's class attribute.
        return {name: getattr(self, field) for name, field in _OP_FIELDS}

    @classmethod
    def from_op_args(cls, arguments: dict) -> MaskSpec:
        """The mask from the ops' arguments (:meth:`op_args`, which hold it normalized already): the entries of
        ``arguments`` named in :data:`OP_FIELDS` (absent ones at their defaults); the others are not read."""
        return cls(**{field: arguments[name] for name, field in cls.OP_FIELDS.items() if name in arguments})

    def cudnn_bounds(self) -> tuple[int | None, int | None]:
        """cuDNN's ``(diagonal_band_left_bound, diagonal_band_right_bound)``.

        cuDNN's left bound counts visible keys *including* the diagonal, so FlashAttention's
        ``left = w`` (w keys back plus self) becomes ``w + 1``; the right bound needs no offset.
        """
        return (self.left + 1 if self.left >= 0 else None, self.right if self.right >= 0 else None)

    def cudnn_diagonal(self, cudnn) -> dict:
        """The SDPA nodes' diagonal-band arguments for this mask (``cudnn``: the frontend module)."""
        left_bound, right_bound = self.cudnn_bounds()
        alignment = cudnn.diagonal_alignment.BOTTOM_RIGHT if self.bottom_right else cudnn.diagonal_alignment.TOP_LEFT
        return dict(diagonal_band_left_bound=left_bound, diagonal_band_right_bound=right_bound, diagonal_alignment=alignment)

    def sees_at_most_one_key(self, *, packed: bool, seq_kv: int) -> bool:
        """Whether no query row can see more than one key, from the shapes and the mask alone: a dense call with one key,
        or the band ``(0, 0)`` (each row its diagonal key). Without sinks such a row's softmax is the constant 1, so the
        output's gradient reaches neither its scores nor q and k: dQ and dK are exactly zero."""
        return (self.left == 0 and self.right == 0) or (not packed and seq_kv == 1)

    def visible_pairs(self, len_q: int, len_kv: int) -> int:
        """How many (query, key) pairs one sequence of these lengths computes. Exact, in constant time (a sequence of
        10**6 tokens costs what one of 10 does)."""
        if len_q <= 0 or len_kv <= 0:
            return 0
        offset = len_kv - len_q if self.bottom_right else 0
        # Visible: offset - left <= j - i <= offset + right. The pairs up to the upper diagonal, less those below the lower.
        upper = _pairs_up_to(offset + self.right, len_q, len_kv) if self.right >= 0 else len_q * len_kv
        lower = _pairs_up_to(offset - self.left - 1, len_q, len_kv) if self.left >= 0 else 0
        return upper - lower

    def widest_row(self, len_kv: int) -> int:
        """The most keys one row can see in a sequence of ``len_kv`` keys."""
        return min(len_kv, self.left + self.right + 1) if self.left >= 0 and self.right >= 0 else len_kv


def _pairs_up_to(diagonal: int, len_q: int, len_kv: int) -> int:
    """Pairs ``(i, j)`` in the ``len_q`` x ``len_kv`` grid with ``j - i <= diagonal``: row ``i`` holds
    ``clamp(i + diagonal + 1, 0, len_kv)`` of them, an arithmetic run clamped at both ends."""
    first = diagonal + 1
    rising = min(max(1 - first, 0), len_q)  # first row holding at least one pair
    full = min(max(len_kv - first, rising), len_q)  # first row holding every key
    n = full - rising
    return n * (2 * (first + rising) + n - 1) // 2 + (len_q - full) * len_kv


def _as_window(window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a (left, right) pair, got {window_size!r}")
    left, right = window_size
    for name, bound in (("left", left), ("right", right)):
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise TypeError(f"window_size {name} bound must be an int, got {bound!r} ({type(bound).__name__})")
        if bound < -1:
            raise ValueError(f"window_size {name} bound must be >= 0, or -1 for unbounded; got {bound}")
    return left, right


def is_int_window(window_size) -> bool:
    """Whether ``window_size`` is a tuple of two plain ints: the form whose equal values mean equal masks.
    ``(1.0, 0)`` and ``(True, 0)`` equal ``(1, 0)`` as keys, but are errors."""
    return type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int and type(window_size[1]) is int


def make_mask_spec(*, causal: bool, bottom_right: bool, window_size) -> MaskSpec:
    """Fold ``causal``/``bottom_right``/``window_size`` into one :class:`MaskSpec`, rejecting contradictions."""
    # Every call asks this; the answer for a given triple never changes (errors are not cached), for int bounds only.
    if is_int_window(window_size) and not torch.compiler.is_compiling():
        return _memoized_mask_spec(bool(causal), bool(bottom_right), window_size)
    return _mask_spec(bool(causal), bool(bottom_right), window_size)


def _mask_spec(causal: bool, bottom_right: bool, window_size) -> MaskSpec:
    left, right = _as_window(window_size)
    if causal:
        if right > 0:
            raise ValueError(
                f"causal=True hides every future key but window_size={tuple(window_size)} admits {right} of them; pass one or the other"
            )
        right = 0
    # Alignment only moves a band; without one it changes nothing, so drop it (one cache entry, one meaning).
    return MaskSpec(left=left, right=right, bottom_right=bottom_right and (left >= 0 or right >= 0))


_memoized_mask_spec = functools.lru_cache(maxsize=256)(_mask_spec)


def effective_lengths(len_q: torch.Tensor, len_kv: torch.Tensor, s_q: int, s_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence lengths as the kernels take them: int32, clamped to ``[0, s]`` on every device
    (so a length past the tensor can never send a kernel out of bounds, and CPU and GPU agree),
    and no query rows where a sequence has no key (cuDNN would leave them unwritten or NaN; they
    are zero by definition: nothing to attend to)."""
    len_kv = len_kv.clamp(0, s_kv).to(torch.int32)
    len_q = torch.where(len_kv > 0, len_q.clamp(0, s_q), 0).to(torch.int32)
    return len_q, len_kv


def visible_keys(mask: MaskSpec, len_q: torch.Tensor, len_kv: torch.Tensor, s_q: int, s_kv: int) -> torch.Tensor:
    """Boolean (B, s_q, s_kv) visibility for sequences of per-batch lengths ``len_q``/``len_kv`` (B,).

    Rows and columns past a sequence's length are never visible.
    """
    device = len_q.device
    i_Q1 = torch.arange(s_q, device=device).view(1, s_q, 1)
    j_1K = torch.arange(s_kv, device=device).view(1, 1, s_kv)
    len_q_B11 = len_q.view(-1, 1, 1).long()
    len_kv_B11 = len_kv.view(-1, 1, 1).long()
    row_BQ1 = i_Q1 + (len_kv_B11 - len_q_B11) if mask.bottom_right else i_Q1
    visible_BQK = (j_1K < len_kv_B11) & (i_Q1 < len_q_B11)
    if mask.right >= 0:
        visible_BQK = visible_BQK & (j_1K <= row_BQ1 + mask.right)
    if mask.left >= 0:
        visible_BQK = visible_BQK & (j_1K >= row_BQ1 - mask.left)
    return visible_BQK
