"""Kernels that stand in for torch's cuDNN SDPA ops and ``torch_attn::_varlen_attn*`` while the provider is installed.

They are registered at the ``CUDA`` dispatch key by :mod:`cudnn_attention.provider`, i.e. *below*
autograd: torch's own autograd formula for each op still runs, saves what these kernels return, and
calls the (also overridden) backward. Each kernel therefore returns exactly what torch's kernel
returns (shapes from torch's meta/fake kernels, so compiled graphs plan for the real tensors).

Served on ``torch.ops.cudnn_attention.forward``/``backward``: calls without attention bias, dropout
or a debug mask that :func:`cudnn_attention.plan.resolve` accepts (the same one
predicate for both directions that :func:`cudnn_attention.attention` uses, so a call never starts
here and finishes elsewhere). Everything else runs torch's own implementation, and is counted
(``stats()["provider"]["torch_forward"]``) with its reason.

The varlen kernels bind their arguments by the op's schema, not by position
(:class:`VarlenSignature`): the ops gained arguments in every release from 2.10 to 2.15.

Legend: B batch, H heads, S sequence, D head dim, T packed tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import batch_chunks, head_groups, validation
from . import plan as plans
from .call import Prepared
from .cudnn_ops import cudnn_backward
from .layouts import split_evenly
from .op_args import op_args
from .policy import count_provider
from .prepare import prepare_aten

__all__ = ["VarlenCall", "VarlenSignature", "sdpa_backward", "sdpa_forward", "varlen_kernels"]


# Whether this torch's logsumexp for the dense cuDNN op is (B, H, S, 1) (its meta kernel says so in
# 2.13) or (B, H, S); set by the provider at install time from the meta kernel. Same bytes either way.
lse_has_trailing_one = True


def _defined(t) -> bool:
    # Tensor (not Tensor?) arguments of an aten backward arrive as None when torch passes an
    # undefined tensor; an empty one means the same thing.
    return t is not None and t.numel() > 0


def _dense_gap(attn_bias, dropout_p, *, debug_mask=False, cum_seq=None) -> str | None:
    """What this project's ops do not do, checked first (no device reads): torch's kernel serves these."""
    if _defined(attn_bias):
        return "attention bias"
    if dropout_p > 0.0:
        return "dropout"
    if debug_mask:
        return "debug attention mask"
    if _defined(cum_seq):
        return "packed sequences (cum_seq)"
    return None


class _Served(NamedTuple):
    """A call this project's ops serve, as the pieces they serve it in (:func:`_parts`): ``[prepared]``, or its batch
    chunks (:mod:`~cudnn_attention.batch_chunks`) or head groups (:mod:`~cudnn_attention.head_groups`) with ``pieces``
    the module that joins their results. Cut once, in :func:`_resolve`: packed head groups are copies of q, k and v."""

    parts: list
    pieces: object  # batch_chunks, head_groups or None


def _resolve(query, key, value, **arguments) -> tuple[_Served | None, str | None]:
    """``(served, reason)``: the core's input checks (:func:`~cudnn_attention.call.prepare_aten`) and
    :func:`~cudnn_attention.plan.resolve` of each part (:func:`_parts`); ``reason`` is None when this project's op
    serves the call (``served`` None otherwise).

    Malformed input (a head-dim mismatch, bad prefix sums, ...) raises the core's error, which
    names the argument: torch's kernel would fail on it too, less clearly. A non-positive scale is
    folded into q (:func:`~cudnn_attention.validation.positive_scale`); the backward undoes it on dQ.
    """
    prepared = prepare_aten(query, key, value, **arguments)
    call = prepared.call
    if validation.nothing_to_compute(prepared.q, prepared.k, max_seqlen_q=call.max_seqlen_q, max_seqlen_kv=call.max_seqlen_kv):
        return None, "empty inputs"
    # A batch past cuDNN's grid limit is served in chunks, a backward past its element limit in head groups (_forward,
    # _backward): each must resolve. A part that would need cutting again resolves to a refused graph, so one cut serves.
    served = _Served(*_parts(prepared))
    for part in served.parts:
        _plan, reason = plans.resolve(part.q, part.k, part.v, call)
        if reason is not None:
            return None, reason
    return served, None


def _parts(prepared: Prepared) -> tuple[list[Prepared], object]:
    """``(parts, module)``: the batch chunks (:mod:`~cudnn_attention.batch_chunks`) or head groups
    (:mod:`~cudnn_attention.head_groups`) cuDNN serves the call in and the module that joins them, or ``([prepared], None)``."""
    count = batch_chunks.chunk_count(prepared)
    if count > 1:
        return batch_chunks.chunks(prepared, count), batch_chunks
    count = head_groups.group_count(prepared)
    if count > 1:
        return head_groups.groups(prepared, count), head_groups
    return [prepared], None


# ----------------------------------------------------------------------------------------------
# aten::_scaled_dot_product_cudnn_attention{,_backward}: dense (B, H, S, D)
# ----------------------------------------------------------------------------------------------


def _dense_resolve(query, key, value, attn_bias, dropout_p, *, is_causal, scale, grad, debug_mask=False, cum_seq=None):
    """``(served, reason)`` for a dense SDPA call (forward or backward): :func:`_dense_gap` first, then :func:`_resolve`."""
    reason = _dense_gap(attn_bias, dropout_p, debug_mask=debug_mask, cum_seq=cum_seq)
    if reason is not None:
        return None, reason
    return _resolve(query, key, value, max_q=query.size(-2), max_kv=key.size(-2), is_causal=is_causal, scale=scale, grad=grad)


def sdpa_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_cudnn_attention`` on CUDA.

    Returns torch's 9-tuple ``(out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
    philox_offset, debug_attn_mask)``; the undefined entries are ``None``.
    """
    S_q, S_kv = query.size(-2), key.size(-2)
    # F.scaled_dot_product_attention asks for the LSE exactly when a backward will follow.
    served, reason = _dense_resolve(
        query, key, value, attn_bias, dropout_p, is_causal=is_causal, scale=scale, grad=compute_log_sumexp, debug_mask=return_debug_mask
    )
    if reason is not None:
        count_provider("torch_forward", reason)
        return torch.ops.aten._cudnn_attention_forward(
            query, key, value, attn_bias, None, None, S_q, S_kv, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, scale=scale
        )
    out, lse = _forward(served)
    count_provider("sdpa_forward")
    B, H = query.shape[0], query.shape[1]
    if not compute_log_sumexp:
        # Our op returns an empty placeholder; torch's kernels (and its meta kernel, which compiled
        # graphs check against) return a full-size buffer. Uninitialized: nothing reads it.
        lse = torch.empty((B, H, S_q), dtype=torch.float32, device=query.device)
    if lse_has_trailing_one:
        lse = lse.unsqueeze(-1)
    # No dropout, so the RNG state is never read (torch's backward ignores it at dropout_p == 0).
    seed = torch.empty((), dtype=torch.long, device=query.device)
    offset = torch.empty((), dtype=torch.long, device=query.device)
    return out, lse, None, None, S_q, S_kv, seed, offset, None


def sdpa_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    """``aten::_scaled_dot_product_cudnn_attention_backward`` on CUDA: ``(dq, dk, dv)``."""
    served, reason = _dense_resolve(query, key, value, attn_bias, dropout_p, is_causal=is_causal, scale=scale, grad=True, cum_seq=cum_seq_q)
    if reason is not None:
        count_provider("torch_backward", reason)
        return torch.ops.aten._cudnn_attention_backward(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            philox_seed,
            philox_offset,
            attn_bias,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            scale=scale,
        )
    lse_BHS = logsumexp.squeeze(-1) if logsumexp.dim() == 4 else logsumexp
    # torch's autograd formula for this op declares its LSE non-differentiable (F.scaled_dot_product_attention
    # returns none), so there is no grad_lse.
    dq, dk, dv, _ = _backward(served, grad_out, out, lse_BHS)
    count_provider("sdpa_backward")
    return _unfold_dq(dq, scale, query.shape[-1]), dk, dv


def _unfold_dq(dq, scale, head_dim: int):
    """dQ of the caller's q when :func:`_resolve` folded a non-positive scale into it (here autograd
    sits above the kernels, so the fold's own derivative is applied by hand: -1 or 0)."""
    scale = validation.resolve_scale(scale, head_dim)
    return dq if scale > 0 else dq * (-1.0 if scale < 0 else 0.0)


# ----------------------------------------------------------------------------------------------
# torch_attn::_varlen_attn{,_out,_backward}: packed (T, H, D) with prefix sums
# ----------------------------------------------------------------------------------------------


class VarlenCall(NamedTuple):
    """One call of a ``torch_attn`` varlen op, its arguments bound by name from the op's schema.

    Fields are the arguments these kernels read, across torch 2.10-2.15. One a release's schema
    lacks keeps its default here: it names a feature that release does not have (2.10 has no
    ``scale`` or ``window_size``; ``enable_gqa`` to ``num_splits`` came in 2.12). ``out`` is the
    output buffer of ``_varlen_attn_out`` and the forward's output in ``_varlen_attn_backward``;
    ``grad_out``, ``lse`` and ``rng_state`` are the backward's. ``unknown`` names the arguments
    this module does not know that carry a value other than their schema default (a feature of
    a newer torch): such a call goes to torch's own kernel.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor | None
    max_q: int
    max_k: int
    is_causal: bool = False
    scale: float | None = None
    window_size: list | None = None
    enable_gqa: bool = False
    seqused_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    num_splits: int | None = None
    out: torch.Tensor | None = None
    grad_out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    rng_state: torch.Tensor | None = None
    unknown: tuple[str, ...] = ()


_VARLEN_FIELDS = frozenset(VarlenCall._fields) - {"unknown"}
_VARLEN_DEFAULTS = tuple((name, VarlenCall._field_defaults.get(name)) for name in VarlenCall._fields if name != "unknown")
# torch 2.15's ``backend`` (an SDPBackend value, flash or cuDNN) picks which of torch's kernels the
# op's body runs. These kernels replace that body, and hand it the value unchanged when torch serves.
_TORCH_KERNEL_CHOICES = frozenset({"backend"})
_REQUIRED = object()


class VarlenSignature:
    """How the dispatcher passes one ``torch_attn`` varlen op's arguments to a Python kernel, read from the op's schema.

    The dispatcher passes the schema's positional arguments by position, leaving out trailing
    ones equal to their defaults, and keyword-only ones by name. Binding by the schema's names
    keeps one kernel right for every release: torch 2.15 appended ``backend`` to all three ops,
    which a binding by position took for one argument too many (a TypeError on every call).
    Written out (about 4 us a call) rather than through ``inspect.Signature.bind`` (20 us).
    """

    def __init__(self, schema):
        self.name = schema.name
        self._positional = tuple(arg.name for arg in schema.arguments if not arg.kwarg_only)
        self._defaults = {arg.name: arg.default_value if arg.has_default_value() else _REQUIRED for arg in schema.arguments}
        # Arguments not read here and not known to be harmless: a call that sets one goes to torch.
        self._unknown = {
            name: default for name, default in self._defaults.items() if name not in _VARLEN_FIELDS and name not in _TORCH_KERNEL_CHOICES
        }

    def bind(self, args: tuple, kwargs: dict) -> VarlenCall:
        """The call the dispatcher made with ``args``/``kwargs``; TypeError when they do not fit the schema."""
        if len(args) > len(self._positional):
            raise TypeError(f"{self.name} takes {len(self._positional)} positional arguments but {len(args)} were given")
        values = dict(zip(self._positional, args))
        for name, value in kwargs.items():
            if name not in self._defaults or name in values:
                raise TypeError(f"{self.name} got an unexpected or repeated argument {name!r}")
            values[name] = value
        if len(values) < len(self._defaults):
            for name, default in self._defaults.items():
                if name not in values:
                    if default is _REQUIRED:
                        raise TypeError(f"{self.name} is missing its argument {name!r}")
                    values[name] = default
        unknown = tuple(name for name, default in self._unknown.items() if not _is_default(values[name], default))
        return VarlenCall(*[values.get(name, default) for name, default in _VARLEN_DEFAULTS], unknown)

    def __repr__(self) -> str:
        return f"VarlenSignature({self.name}({', '.join(self._defaults)}))"


def _is_default(value, default) -> bool:
    if default is _REQUIRED:
        return False  # a required argument this module does not know: it always means something
    return value is default or (not isinstance(value, torch.Tensor) and value == default)


def varlen_kernels(*, schemas: dict, torch_kernels: dict) -> dict:
    """CUDA kernels for the ``torch_attn`` varlen ops named in ``schemas`` (``{"_varlen_attn": schema, ...}``).

    Each binds its arguments by its op's schema (:class:`VarlenSignature`), so one set of kernels
    serves every torch from 2.10 (the first with these ops) to 2.15. A call these kernels do not
    serve goes to ``torch_kernels[name]`` (torch's own body of that op) with the arguments exactly
    as the dispatcher passed them.
    """
    unknown_ops = sorted(set(schemas) - set(_VARLEN_SERVE))
    if unknown_ops:
        raise ValueError(f"no override for torch_attn ops {unknown_ops}; name only {sorted(_VARLEN_SERVE)}")
    return {name: _varlen_kernel(name, VarlenSignature(schema), torch_kernels[name]) for name, schema in schemas.items()}


def _varlen_kernel(name: str, signature: VarlenSignature, torch_kernel):
    serve, direction = _VARLEN_SERVE[name]

    def kernel(*args, **kwargs):
        call = _loose_maxima_clamped(signature.bind(args, kwargs))
        served, reason = _varlen_resolve(call)
        if reason is not None:
            count_provider(f"torch_{direction}", reason)
            return torch_kernel(*args, **kwargs)
        return serve(call, served)

    # Named for its op: every kernel is otherwise "kernel" in tracebacks and profiles.
    kernel.__name__ = kernel.__qualname__ = f"cudnn_attention_{name.lstrip('_')}"
    return kernel


def _loose_maxima_clamped(call: VarlenCall) -> VarlenCall:
    """``call`` with ``max_q``/``max_k`` no larger than their side's token count. torch's varlen ops, like
    FlashAttention's, take any upper bound on the documents' lengths and serve a loose one; one past the token
    count bounds nothing more than the count itself, while the core refuses it as a mistake (it cannot bound
    a real document), so here it is clamped to keep serving what torch serves."""
    tokens_q = call.query.shape[0] if isinstance(call.query, torch.Tensor) else None
    tokens_k = call.key.shape[0] if isinstance(call.key, torch.Tensor) else None
    loose_q = type(call.max_q) is int and tokens_q is not None and call.max_q > tokens_q
    loose_k = type(call.max_k) is int and tokens_k is not None and call.max_k > tokens_k
    if not (loose_q or loose_k):
        return call
    return call._replace(max_q=tokens_q if loose_q else call.max_q, max_k=tokens_k if loose_k else call.max_k)


def _varlen_resolve(call: VarlenCall) -> tuple[_Served | None, str | None]:
    """``(served, reason)`` for a varlen call (forward or backward)."""
    if call.unknown:
        return None, f"arguments this version of cudnn_attention does not know: {', '.join(call.unknown)}"
    if call.seqused_k is not None or call.block_table is not None:
        return None, "paged or partially used KV cache (seqused_k/block_table)"
    if call.num_splits is not None:
        return None, "num_splits (flash's split-KV control)"
    if call.cu_seq_k is None:
        return None, "no cu_seq_k"
    window = (-1, -1) if call.window_size is None else tuple(int(bound) for bound in call.window_size)
    # torch 2.15's cuDNN backend keeps FlashAttention's bottom-right meaning: it declines the cases where cuDNN's differs.
    return _resolve(
        call.query,
        call.key,
        call.value,
        cu_seqlens_q=call.cu_seq_q,
        cu_seqlens_kv=call.cu_seq_k,
        max_q=call.max_q,
        max_kv=call.max_k,
        is_causal=call.is_causal,
        window_size=window,
        scale=call.scale,
        grad=True,
    )


def _forward(served: _Served):
    """``(out, lse)`` of a served call through the forward op (the provider's kernels sit below torch's autograd), one
    launch per part (a batch past cuDNN's grid limit in chunks, a call whose backward passes its element limit in head
    groups), ``lse`` None unless asked for then."""
    results = [
        torch.ops.cudnn_attention.forward(part.q, part.k, part.v, need_lse=part.call.need_lse, **op_args(part.call, part.lengths, None))
        for part in served.parts
    ]
    return results[0] if served.pieces is None else served.pieces.joined(results)


def _backward(served: _Served, grad_out, out, lse):
    """dQ, dK, dV through the backward op, one launch per part (the incoming gradient, output and LSE cut alike: batch
    chunks slice them, head groups lay them out as each group's forward would have, :func:`~cudnn_attention.head_groups.saved_heads`).
    torch's autograd formulas for these ops declare their LSE non-differentiable and ignore its gradient, so there is
    none to pass on."""
    parts, pieces = served.parts, served.pieces
    if pieces is None:
        rows = [(grad_out, out, lse)]
    elif pieces is head_groups:
        rows = head_groups.saved_heads(parts, grad_out, out, lse)
    else:
        rows = zip(*(split_evenly(t, len(parts), 0) for t in (grad_out, out, lse)))
    results = [
        cudnn_backward(grad_part, part.q, part.k, part.v, out_part, lse_part, call=part.call, lengths=part.lengths)
        for part, (grad_part, out_part, lse_part) in zip(parts, rows)
    ]
    # Head groups may share a kv head (MQA), whose dK and dV are then the sum of theirs (joined_gradients).
    return results[0] if pieces is None else pieces.joined_gradients(parts, results)


def _serve_forward(call: VarlenCall, served: _Served):
    """``_varlen_attn``: ``(out (T, H, D), lse (H, T) float32, rng_state (2,) uint64)``."""
    out, lse_TH = _forward(served)
    count_provider("varlen_forward")
    # torch's varlen LSE is (H, T), contiguous (its fake kernel allocates it so). No dropout: torch's own body returns
    # a zero RNG state here too.
    return out, lse_TH.t().contiguous(), torch.zeros((2,), dtype=torch.uint64, device=out.device)


def _serve_forward_out(call: VarlenCall, served: _Served):
    """``_varlen_attn_out``: writes ``out`` and returns ``lse`` (H, T)."""
    result, lse_TH = _forward(served)
    count_provider("varlen_forward")
    call.out.copy_(result)
    return lse_TH.t().contiguous()


def _serve_backward(call: VarlenCall, served: _Served):
    """``_varlen_attn_backward``: ``(dq, dk, dv)``."""
    dq, dk, dv, _ = _backward(served, call.grad_out, call.out, call.lse.t().contiguous())
    count_provider("varlen_backward")
    return _unfold_dq(dq, call.scale, call.query.shape[-1]), dk, dv


# op name -> (what serves it, the direction its hand-offs to torch are counted under)
_VARLEN_SERVE = {
    "_varlen_attn": (_serve_forward, "forward"),
    "_varlen_attn_out": (_serve_forward_out, "forward"),
    "_varlen_attn_backward": (_serve_backward, "backward"),
}
