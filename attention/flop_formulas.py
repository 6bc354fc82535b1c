"""FLOP formulas for ``torch.utils.flop_counter``: what this package's ops, and optionally torch's fused SDPA, compute.

``FlopCounterMode`` (and what reads it: Lightning's ``measure_flops``, MFU callbacks) counts an op only when its
table holds a formula for it. :func:`register` adds one for ``cudnn_attention::forward`` and ``::backward``;
``import cudnn_attention`` calls it, as it registers the ops' fake kernels and autograd formula: it describes the
package's own ops and changes nothing else (a counter built before the import does not see them).

The count is the work the masks leave: for each query row the keys it sees (causal, windows ``(left, right)``,
bottom-right alignment, each sequence's length in a padded batch, each document's in a packed one), times
``2 * (D + D_v)`` per query head (``Q K^T`` and ``P V``; GQA counts every query head). The backward counts what
torch counts for its SDPA backward (``torch/utils/flop_counter.py``, ``sdpa_backward_flop_count``): the scores
recomputed, ``dO V^T``, ``P^T dO``, ``dS K`` and ``Q^T dS``, ``2 * (3 D + 2 D_v)`` per visible pair and query head
(2.5 times the forward when ``D == D_v``). Softmax, sinks and masking are not counted, as torch counts none of them.

Lengths are read from the index tensors (``seqlens_*``, ``cu_seqlens_*``). On a GPU that reads device memory, which
synchronizes: acceptable here only because counting FLOPs is no hot path (no training step runs under a counter).
Tensors without values (meta or fake tensors: ``measure_flops`` on a meta model, ``torch.compile``'s tracing) give an
upper bound instead: see :func:`forward_flops`.

torch's own formulas for its fused SDPA ops ignore ``is_causal`` (a causal call is counted as a full one, twice its
work). :func:`sdpa_flop_formulas` gives formulas that count it, for ``FlopCounterMode(custom_mapping=...)``, and
:func:`sdpa_masks_counted` puts them in torch's table for the length of a ``with`` block (for tools that build
their own counter, such as ``measure_flops``). Neither happens unless asked for.

Example:
    >>> from torch.utils.flop_counter import FlopCounterMode
    >>> with FlopCounterMode(display=False) as counter:
    ...     cudnn_attention.attention(q, k, v, causal=True).sum().backward()
    >>> counter.get_total_flops()  # the causal half, forward and backward
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import torch

from . import _compat
from .masking import MaskSpec

__all__ = ["attention_pairs", "backward_flops", "forward_flops", "register", "sdpa_flop_formulas", "sdpa_masks_counted"]


def attention_pairs(
    *, lengths_q: Sequence[int], lengths_kv: Sequence[int], window_left: int = -1, window_right: int = -1, bottom_right: bool = False
) -> int:
    """How many (query, key) pairs attention computes over sequences of these lengths, summed.

    Query ``i`` sees key ``j`` iff ``i - window_left <= j <= i + window_right`` (FlashAttention's convention, -1
    leaves a side unbounded; causal is ``window_right = 0``), with ``i`` shifted by ``len_kv - len_q`` when
    ``bottom_right``: :meth:`cudnn_attention.masking.MaskSpec.visible_pairs`, per sequence.
    """
    mask = MaskSpec(window_left, window_right, bool(bottom_right))
    return sum(mask.visible_pairs(int(n_q), int(n_kv)) for n_q, n_kv in zip(lengths_q, lengths_kv))


# ----------------------------------------------------------------------------------------------
# The package's ops
# ----------------------------------------------------------------------------------------------


def _bind(packet, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by name, from its schema: a formula reads them the same way whether the schema takes them
    positionally or as keywords, with defaults for those left out."""
    bound = {}
    for index, argument in enumerate(_compat.op_schema(packet).arguments):
        if index < len(args):
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value if argument.has_default_value() else None
    return bound


def _dense_lengths(bound: dict, s_q: int, s_kv: int) -> tuple[list[int], list[int]]:
    """Each sequence's (query, key) lengths in a dense batch: the shapes, or the padded batch's lengths clamped as the
    kernels clamp them; every sequence at full length (an upper bound) when the lengths hold no values."""
    batch = bound["q"].shape[0]
    lengths = []
    for name, full in (("seqlens_q", s_q), ("seqlens_kv", s_kv)):
        given = bound.get(name)
        if given is None or not _compat.holds_values(given):
            lengths.append([full] * batch)
        else:
            lengths.append([min(max(n, 0), full) for n in given.tolist()])  # synchronizes on a GPU: see the module's note
    return lengths[0], lengths[1]


def _packed_pairs(bound: dict, mask: MaskSpec) -> int:
    """Visible pairs of a packed call: per document from the prefix sums, or, without their values, the smaller of
    every document at its maximum and every query token seeing as many keys as a row can (the widest window, or the
    longest document). A maximum of 0 or less counts as the token count, so the bound holds whatever it meant."""
    cu_q, cu_kv = bound["cu_seqlens_q"], bound["cu_seqlens_kv"]
    if _compat.holds_values(cu_q) and _compat.holds_values(cu_kv):
        starts_q, starts_kv = cu_q.tolist(), cu_kv.tolist()  # synchronizes on a GPU: see the module's note
        return sum(
            mask.visible_pairs(q_end - q_start, kv_end - kv_start)
            for (q_start, q_end), (kv_start, kv_end) in zip(itertools.pairwise(starts_q), itertools.pairwise(starts_kv))
        )
    tokens_q, tokens_kv, documents = bound["q"].shape[0], bound["k"].shape[0], cu_q.shape[0] - 1
    max_q = min(bound["max_seqlen_q"], tokens_q) if bound["max_seqlen_q"] > 0 else tokens_q
    max_kv = min(bound["max_seqlen_kv"], tokens_kv) if bound["max_seqlen_kv"] > 0 else tokens_kv
    every_document_longest = documents * mask.visible_pairs(max_q, max_kv)
    return min(every_document_longest, min(tokens_q, documents * max_q) * mask.widest_row(max_kv))


def _visible_pairs_and_dims(bound: dict) -> tuple[int, int, int, int]:
    """``(visible pairs per query head, query heads, D, D_v)`` of a forward or backward call."""
    q, v = bound["q"], bound["v"]
    mask = MaskSpec.from_op_args(bound)
    if bound.get("cu_seqlens_q") is not None:
        pairs = _packed_pairs(bound, mask)
    else:
        lengths_q, lengths_kv = _dense_lengths(bound, q.shape[2], bound["k"].shape[2])
        pairs = sum(mask.visible_pairs(n_q, n_kv) for n_q, n_kv in zip(lengths_q, lengths_kv))
    return pairs, q.shape[1], q.shape[-1], v.shape[-1]


def forward_flops(*args, out_val=None, **kwargs) -> int:
    """FLOPs of one ``cudnn_attention::forward`` call (``torch.utils.flop_counter``'s raw-formula signature).

    ``2 * (D + D_v)`` per visible (query, key) pair per query head (see the module's docstring). Index tensors
    without values (meta, fake) give an upper bound: a padded batch counts every sequence at full length; a packed
    one the smaller of (documents x the pairs of one document of ``max_seqlen_q`` queries and ``max_seqlen_kv``
    keys) and (query tokens in documents, at most ``documents x max_seqlen_q``, x the most keys a row can see:
    ``min(max_seqlen_kv, left + right + 1)`` with both window sides bounded, else ``max_seqlen_kv``)."""
    pairs, heads, d_qk, d_v = _visible_pairs_and_dims(_bind(torch.ops.cudnn_attention.forward, args, kwargs))
    return pairs * heads * 2 * (d_qk + d_v)


def backward_flops(*args, out_val=None, **kwargs) -> int:
    """FLOPs of one ``cudnn_attention::backward`` call: ``2 * (3 D + 2 D_v)`` per visible pair per query head, torch's
    count for its SDPA backward, with the pairs and bounds of :func:`forward_flops`. One count per call, whichever
    gradients arrive: a loss that uses both the output and the LSE costs cuDNN one more launch of its backward graph
    (see ``lse_gradient.lse_gradient_operands``), which is not counted; the math needs no more products."""
    pairs, heads, d_qk, d_v = _visible_pairs_and_dims(_bind(torch.ops.cudnn_attention.backward, args, kwargs))
    return pairs * heads * 2 * (3 * d_qk + 2 * d_v)


def register() -> None:
    """Add :func:`forward_flops` and :func:`backward_flops` to ``torch.utils.flop_counter``'s table, for counters
    built from now on; a second call does nothing."""
    from torch.utils.flop_counter import register_flop_formula

    registry = _compat.flop_registry()
    for packet, formula in ((torch.ops.cudnn_attention.forward, forward_flops), (torch.ops.cudnn_attention.backward, backward_flops)):
        if packet not in registry:
            register_flop_formula(packet, get_raw=True)(formula)


# ----------------------------------------------------------------------------------------------
# torch's fused SDPA ops, on request
# ----------------------------------------------------------------------------------------------

# (op name, direction, name of its mask argument or None). Every one takes (B, H, S, D)
# tensors and is_causal with SDPA's meaning: the causal diagonal at the top left (query i sees keys 0..i).
_SDPA_OPS = (
    ("_scaled_dot_product_flash_attention", "forward", None),
    ("_scaled_dot_product_efficient_attention", "forward", "attn_bias"),
    ("_scaled_dot_product_cudnn_attention", "forward", "attn_bias"),
    ("_scaled_dot_product_flash_attention_for_cpu", "forward", "attn_mask"),
    ("_scaled_dot_product_flash_attention_backward", "backward", None),
    ("_scaled_dot_product_efficient_attention_backward", "backward", "attn_bias"),
    ("_scaled_dot_product_cudnn_attention_backward", "backward", "attn_bias"),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "backward", "attn_mask"),
)


def _sdpa_formula(packet, direction: str, mask_argument: str | None, fallback):
    """A raw formula for one of torch's fused SDPA ops: :func:`attention_pairs` with SDPA's top-left causal mask when
    ``is_causal`` is set and no mask tensor is given (a mask's values are not read: it counts every pair, as torch
    does), per query head; ``fallback`` (torch's own formula, or None) for what is not a dense (B, H, S, D) call."""

    def formula(*args, out_val=None, **kwargs) -> int:
        bound = _bind(packet, args, kwargs)
        query, key, value = bound["query"], bound["key"], bound["value"]
        if query.dim() != 4:  # nested (jagged) tensors: torch's formula unpacks them
            return fallback(*args, out_val=out_val, **kwargs) if fallback is not None else 0
        batch, heads, s_q, d_qk = query.shape
        s_kv, d_v = key.shape[2], value.shape[-1]
        causal = bool(bound.get("is_causal")) and (mask_argument is None or bound.get(mask_argument) is None)
        pairs = batch * MaskSpec(right=0 if causal else -1).visible_pairs(s_q, s_kv)
        per_pair = 2 * (d_qk + d_v) if direction == "forward" else 2 * (3 * d_qk + 2 * d_v)
        return pairs * heads * per_pair

    formula._get_raw = True  # FlopCounterMode(custom_mapping=...) hands a formula so marked the tensors, not their shapes
    return formula


def sdpa_flop_formulas() -> dict:
    """Formulas for torch's fused SDPA ops (flash, efficient, cuDNN and the CPU flash kernel, forward and backward)
    that count ``is_causal`` (torch's count a causal call as a full one), keyed by op packet, for
    ``FlopCounterMode(custom_mapping=sdpa_flop_formulas())``. Changes nothing by itself.

    SDPA's math path (``attn_mask`` tensors of any kind on some backends, float64, ...) is no fused op: the counter
    sees its matrix products, which compute every pair whatever the mask."""
    registry = _compat.flop_registry()
    formulas = {}
    for name, direction, mask_argument in _SDPA_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            formulas[packet] = _sdpa_formula(packet, direction, mask_argument, registry.get(packet))
    return formulas


@contextlib.contextmanager
def sdpa_masks_counted() -> Iterator[None]:
    """Within the block, counters built there (``measure_flops`` builds its own) count torch's fused SDPA ops with
    :func:`sdpa_flop_formulas`; torch's table is restored on exit. Not thread-safe: the table is process-wide.

    Example:
        >>> with sdpa_masks_counted():
        ...     flops = measure_flops(model, lambda: model(ids))
    """
    registry = _compat.flop_registry()
    replaced = sdpa_flop_formulas()
    saved = {packet: registry[packet] for packet in replaced if packet in registry}
    registry.update(replaced)
    try:
        yield
    finally:
        for packet in replaced:
            if packet in saved:
                registry[packet] = saved[packet]
            else:
                registry.pop(packet, None)
