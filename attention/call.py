"""One value for a call, from the public API to the launch: what it is, how it is prepared, how it is keyed.

The public functions and the SDPA provider validate their arguments once, here
(:func:`prepare_dense`, :func:`prepare_packed`, :func:`prepare_aten`), into a :class:`Prepared` call: an
:class:`AttentionCall` (the options), its index tensors as one :class:`Lengths`, and q/k/v/sinks as the
kernels take them. That value travels unchanged to the plan, the graph cache (it is part of every key,
see :func:`served_key`) and the kernels. The ops take no Python objects, so the one flat form of a call,
the ops' arguments by name, is written here too (:func:`op_args`, :func:`from_op_args`).

Legend: B batch, H heads, S sequence, D head dim, T packed tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import validation
from .layouts import token_major
from .masking import MaskSpec, effective_lengths, is_int_window, make_mask_spec
from .packed_batch import PackedBatch, registered_batch

__all__ = [
    "NO_LENGTHS",
    "OP_OPTIONS",
    "OP_TAIL_SCHEMA",
    "AttentionCall",
    "Lengths",
    "Prepared",
    "argument_options",
    "from_op_args",
    "needs_grad",
    "op_args",
    "packed_lengths",
    "padding_lengths",
    "prepare_aten",
    "prepare_dense",
    "prepare_packed",
    "served_key",
    "tensor_geometry",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCall:
    """A validated call's options (everything but the tensors).

    ``max_seqlen_*`` are the dense sequence lengths (S_q, S_kv) or the packed documents' bounds;
    ``scale`` is already positive (see :func:`cudnn_attention.validation.positive_scale`).
    """

    packed: bool
    padded: bool = False
    documents: int = 0  # packed: len(cu_seqlens) - 1; dense: 0
    max_seqlen_q: int
    max_seqlen_kv: int
    scale: float
    mask: MaskSpec = MaskSpec()
    has_sinks: bool = False
    need_lse: bool = False  # the caller wants the LSE, or the backward will need it
    needs_grad: bool = False
    deterministic: bool | None = None  # the backward's algorithm; None: torch's setting when the backward runs

    def replace(self, **changes) -> AttentionCall:
        return dataclasses.replace(self, **changes)

    def backward_deterministic(self) -> bool:
        """Whether the backward runs cuDNN's deterministic algorithm: the call's own ``deterministic``, else
        ``torch.are_deterministic_algorithms_enabled()`` as it reads now."""
        return self.deterministic if self.deterministic is not None else torch.are_deterministic_algorithms_enabled()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Lengths:
    """A call's index tensors, as the kernels take them: a padded dense call's per-row lengths (int32 (B,),
    already clamped, see :func:`cudnn_attention.masking.effective_lengths`), or a packed call's batch (its prefix
    sums and what is known and derived of them, :class:`~cudnn_attention.packed_batch.PackedBatch`); None where
    the call has none."""

    seqlens_q: torch.Tensor | None = None
    seqlens_kv: torch.Tensor | None = None
    batch: PackedBatch | None = None

    @property
    def cu_seqlens_q(self) -> torch.Tensor | None:
        return None if self.batch is None else self.batch.cu_seqlens_q

    @property
    def cu_seqlens_kv(self) -> torch.Tensor | None:
        return None if self.batch is None else self.batch.cu_seqlens_kv

    def tensors(self) -> tuple:
        """The four index tensors (None where absent), in the ops' order."""
        return self.seqlens_q, self.seqlens_kv, self.cu_seqlens_q, self.cu_seqlens_kv


NO_LENGTHS = Lengths()


class Prepared(NamedTuple):
    """A validated call: its options, and the tensors as the kernels take them (a copy or a folded scale may
    have replaced the caller's). ``key`` is the arguments' key when they came through unchanged (see
    :func:`served_key`; None: the next call must validate again). A tuple, not a frozen dataclass: one is made
    per call, and a tuple costs a third of the time."""

    call: AttentionCall
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor | None
    lengths: Lengths
    key: tuple | None = None


def needs_grad(q, k, v, sinks) -> bool:
    """Whether a backward will follow: grad mode is on and an input requires it."""
    # Plain boolean logic rather than any(generator): this runs on every call.
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    )


# ----------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------


def tensor_geometry(q, k, v) -> tuple:
    """What of q/k/v validation, a plan and a graph depend on: shapes, strides, dtype and device."""
    return q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, k.dtype, v.dtype, k.device, v.device


def served_key(options: tuple, q, k, v) -> tuple:
    """The one form of every key the memo beside the graph cache holds (see
    :func:`cudnn_attention.cudnn_graphs.memoize`): ``options``, q/k/v's :func:`tensor_geometry` and the
    determinism setting.

    A key must hold everything that changes what it keeps: for an argument key (:func:`argument_options`)
    every option as the caller passed it, the index tensors' shapes, dtypes and devices (their values are
    read per call) and the sink-forward choice; for a plan, the :class:`AttentionCall` and the sink-forward
    choice; for a graph, its direction and the call. The geometry and the determinism setting are in every
    key, so no caller adds them by hand.
    """
    return options, tensor_geometry(q, k, v), torch.are_deterministic_algorithms_enabled()


def argument_options(q, k, v, scale, causal, bottom_right, window_size, sinks, return_lse, index_tensors, ints, sink_forward, options):
    """The options part of an argument key (:func:`served_key`), or None (validate every time) for tensor
    subclasses, options of other types than the documented ones (``True == 1`` and ``1.0 == 1`` as keys, but
    validation tells them apart) and while tracing. ``index_tensors``: the index tensors (their shapes,
    dtypes and devices go in); ``ints``: the packed maxima; ``options``: the values of the :data:`OP_OPTIONS` but the scale."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if not (scale is None or type(scale) is float) or type(causal) is not bool or type(bottom_right) is not bool:
        return None
    if not is_int_window(window_size):
        return None
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        return None
    index_key = []
    for t in index_tensors:
        if t is None:
            index_key.append(None)
        elif isinstance(t, torch.Tensor):
            index_key.append((t.shape, t.dtype, t.device))
        else:
            return None
    for n in ints:
        if type(n) is not int:
            return None
    for value in options:
        if not (value is None or type(value) is bool):
            return None
    if torch.compiler.is_compiling():
        return None
    sinks_key = None if sinks is None else (sinks.shape, sinks.dtype, sinks.device)
    grad = needs_grad(q, k, v, sinks)
    return (
        "arguments",
        scale,
        causal,
        bottom_right,
        window_size,
        bool(return_lse),
        grad,
        sinks_key,
        tuple(index_key),
        ints,
        sink_forward,
        options,
    )


# ----------------------------------------------------------------------------------------------
# Prepare
# ----------------------------------------------------------------------------------------------


def padding_lengths(seqlens_q, seqlens_kv, B: int, S_q: int, S_kv: int, device) -> Lengths:
    """A padded call's per-row lengths as the kernels take them; an absent side is the full length."""
    len_q = seqlens_q if seqlens_q is not None else torch.full((B,), S_q, dtype=torch.int32, device=device)
    len_kv = seqlens_kv if seqlens_kv is not None else torch.full((B,), S_kv, dtype=torch.int32, device=device)
    len_q, len_kv = effective_lengths(len_q, len_kv, S_q, S_kv)
    return Lengths(seqlens_q=len_q, seqlens_kv=len_kv)


def prepare_dense(
    q, k, v, *, scale, causal, bottom_right, window_size, sinks, seqlens_q, seqlens_kv, return_lse, validate, grad=None, key=None, **options
) -> Prepared:
    """Validate a dense (B, H, S, D) call (see :func:`cudnn_attention.attention`; errors name the value).

    ``grad``: whether a backward follows (None: from the tensors, :func:`needs_grad`). ``key``: the
    arguments' key, kept only if no tensor had to be replaced on the way. ``options``: the call's
    :data:`OP_OPTIONS` other than the scale, as the caller passed them."""
    given = (q, k, v)
    q, k, v = validation.check_qkv(q, k, v, packed=False)
    mask = make_mask_spec(causal=causal, bottom_right=bottom_right, window_size=window_size)
    q, scale = validation.positive_scale(q, validation.resolve_scale(scale, q.shape[-1]))
    sinks = validation.check_sinks(sinks, q, q.shape[1])
    B, S_q, S_kv = q.shape[0], q.shape[2], k.shape[2]
    seqlens_q = validation.check_seqlens(seqlens_q, "seqlens_q", B, q.device)
    seqlens_kv = validation.check_seqlens(seqlens_kv, "seqlens_kv", B, q.device)
    if validate:
        for name, lengths, limit in (("seqlens_q", seqlens_q, S_q), ("seqlens_kv", seqlens_kv, S_kv)):
            if lengths is not None:
                validation.validate_seqlens(lengths, name, limit)
    padded = seqlens_q is not None or seqlens_kv is not None
    lengths = padding_lengths(seqlens_q, seqlens_kv, B, S_q, S_kv, q.device) if padded else NO_LENGTHS
    grad = needs_grad(q, k, v, sinks) if grad is None else grad
    call = AttentionCall(
        packed=False,
        padded=padded,
        max_seqlen_q=S_q,
        max_seqlen_kv=S_kv,
        scale=scale,
        mask=mask,
        has_sinks=sinks is not None,
        need_lse=return_lse or grad,
        needs_grad=grad,
        **_checked(options),
    )
    return Prepared(call, q, k, v, sinks, lengths, key if _unchanged(given, q, k, v) else None)


def prepare_packed(
    q,
    k,
    v,
    *,
    cu_seqlens_q,
    cu_seqlens_kv,
    max_seqlen_q,
    max_seqlen_kv,
    scale,
    causal,
    bottom_right,
    window_size,
    sinks,
    return_lse,
    validate,
    grad=None,
    key=None,
    **options,
) -> Prepared:
    """Validate a packed (T, H, D) call (see :func:`cudnn_attention.varlen_attention`), as
    :func:`prepare_dense` does a dense one. A training call's q/k/v become token-major (see
    :func:`~cudnn_attention.layouts.token_major`: cuDNN's packed backward needs it)."""
    given = (q, k, v)
    q, k, v = validation.check_qkv(q, k, v, packed=True)
    max_seqlen_q, max_seqlen_kv = validation.check_cu_seqlens(
        cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, q.device, total_q=q.shape[0], total_kv=k.shape[0]
    )
    mask = make_mask_spec(causal=causal, bottom_right=bottom_right, window_size=window_size)
    q, scale = validation.positive_scale(q, validation.resolve_scale(scale, q.shape[-1]))
    sinks = validation.check_sinks(sinks, q, q.shape[1])
    batch = registered_batch(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0])
    batch = batch.check(max_seqlen_q, max_seqlen_kv, validate=validate, cover_all=False)
    grad = needs_grad(q, k, v, sinks) if grad is None else grad
    if grad:
        q, k, v = token_major(q), token_major(k), token_major(v)
    call = AttentionCall(
        packed=True,
        documents=cu_seqlens_q.shape[0] - 1,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        scale=scale,
        mask=mask,
        has_sinks=sinks is not None,
        need_lse=return_lse or grad,
        needs_grad=grad,
        **_checked(options),
    )
    return Prepared(call, q, k, v, sinks, Lengths(batch=batch), key if _unchanged(given, q, k, v) else None)


def packed_lengths(cu_seqlens_q, cu_seqlens_kv, tokens_q: int, tokens_kv: int) -> Lengths:
    """A packed call's :class:`Lengths`: the batch kept for these prefix sums (what was proved and derived of them), or a
    new one (see :func:`~cudnn_attention.packed_batch.registered_batch`; nothing is checked here)."""
    return Lengths(batch=registered_batch(cu_seqlens_q, cu_seqlens_kv, tokens_q, tokens_kv))


def prepare_aten(
    query,
    key,
    value,
    *,
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    max_q: int,
    max_kv: int,
    is_causal: bool,
    scale,
    window_size=(-1, -1),
    grad: bool,
) -> Prepared:
    """Validate a call of one of torch's attention ops the provider overrides (``aten::_scaled_dot_product_cudnn_attention``,
    ``torch_attn::_varlen_attn*``), with its arguments' meanings: SDPA's causal mask is top-left aligned; the varlen
    ops run FlashAttention, whose causal/window diagonal is anchored at each document's last query and key (bottom
    right; the same as top left when lengths match). ``grad``: whether a backward follows (the varlen ops cannot see
    it, and always say True so that both directions resolve one plan); a varlen call's q/k/v are then token-major in
    both directions, so the forward's graph and the backward's see one layout."""
    if cu_seqlens_q is None:
        return prepare_dense(
            query,
            key,
            value,
            scale=scale,
            causal=is_causal,
            bottom_right=False,
            window_size=window_size,
            sinks=None,
            seqlens_q=None,
            seqlens_kv=None,
            return_lse=grad,
            validate=False,
            grad=grad,
        )
    query, key, value = token_major(query), token_major(key), token_major(value)
    return prepare_packed(
        query,
        key,
        value,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        scale=scale,
        causal=is_causal,
        bottom_right=True,
        window_size=window_size,
        sinks=None,
        return_lse=grad,
        validate=False,
        grad=grad,
    )


def _checked(options: dict) -> dict:
    """The call's :data:`OP_OPTIONS` (but the scale, checked apart) as passed, each a bool or None (every one so far)."""
    for name, value in options.items():
        if name not in OP_OPTIONS or name == "scale":
            raise TypeError(f"unexpected option {name!r}")
        if not (value is None or type(value) is bool):
            raise TypeError(f"{name} must be a bool or None, got {value!r} ({type(value).__name__})")
    return options


def _unchanged(given, q, k, v) -> bool:
    # Identity, not ==: a tuple compares unequal tensors elementwise.
    return given[0] is q and given[1] is k and given[2] is v


# ----------------------------------------------------------------------------------------------
# The ops' flat form
# ----------------------------------------------------------------------------------------------

# The ops' arguments after q/k/v (and, in the backward, out/lse/grad_lse), shared by both schemas: tensors positional
# with defaults (torch's autograd registration differentiates positional tensors only, and the sinks need a gradient),
# the rest keyword-only. The call's options the ops take as they are, by the same name (OP_OPTIONS), close the tail:
# a new one is one more entry there and one more field of AttentionCall.
OP_OPTIONS = {"scale": "float scale", "deterministic": "bool? deterministic=None"}
OP_TAIL_SCHEMA = (
    "Tensor? sinks=None, Tensor? seqlens_q=None, Tensor? seqlens_kv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, "
    f"*, int max_seqlen_q=0, int max_seqlen_kv=0, {MaskSpec.OP_SCHEMA}, " + ", ".join(OP_OPTIONS.values())
)


def op_args(call: AttentionCall, lengths: Lengths, sinks) -> dict:
    """The ops' arguments for ``call`` by name, after q/k/v (see ``OP_TAIL_SCHEMA``); dense maxima are the shapes' (0)."""
    return dict(
        sinks=sinks,
        seqlens_q=lengths.seqlens_q,
        seqlens_kv=lengths.seqlens_kv,
        cu_seqlens_q=lengths.cu_seqlens_q,
        cu_seqlens_kv=lengths.cu_seqlens_kv,
        max_seqlen_q=call.max_seqlen_q if call.packed else 0,
        max_seqlen_kv=call.max_seqlen_kv if call.packed else 0,
        **call.mask.op_args(),
        **{name: getattr(call, name) for name in OP_OPTIONS},
    )


def from_op_args(
    q,
    k,
    *,
    need_lse: bool,
    grad: bool,
    sinks=None,
    seqlens_q=None,
    seqlens_kv=None,
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    max_seqlen_q: int = 0,
    max_seqlen_kv: int = 0,
    **options,
) -> tuple[AttentionCall, Lengths]:
    """The call value and its lengths, rebuilt from the ops' arguments (:func:`op_args`; ``options``: the mask's
    (:data:`~cudnn_attention.masking.MaskSpec.OP_SCHEMA`) and the :data:`OP_OPTIONS`, which the dispatcher leaves out
    where they hold their defaults)."""
    mask = MaskSpec.from_op_args(**{name: options.pop(name) for name in MaskSpec().op_args() if name in options})
    packed = cu_seqlens_q is not None
    call = AttentionCall(
        packed=packed,
        padded=seqlens_q is not None,
        documents=cu_seqlens_q.shape[0] - 1 if packed else 0,
        max_seqlen_q=max_seqlen_q if packed else q.shape[2],
        max_seqlen_kv=max_seqlen_kv if packed else k.shape[2],
        mask=mask,
        has_sinks=sinks is not None,
        need_lse=need_lse,
        needs_grad=grad,
        **options,
    )
    if packed:
        return call, packed_lengths(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0])
    return call, Lengths(seqlens_q=seqlens_q, seqlens_kv=seqlens_kv)
