"""Which path served each call, and what happens when cuDNN cannot serve one.

Every call is counted: the cuDNN forward/backward, or the exact PyTorch fallback by reason.
A fallback warns once per reason; in strict mode it raises instead (``strict()``,
``set_strict(True)``, or the environment variable ``CUDNN_ATTENTION_STRICT=1``).

Under ``torch.compile`` none of that Python may run while tracing (Dynamo cannot read a
``ContextVar``, and a count taken then would be taken once per compile, not per call), so a
compiled fallback carries it into the graph instead: :func:`fallback_in_graph` passes the output
through the ``cudnn_attention::noted_fallback`` op, whose kernel does the bookkeeping each time the
graph runs (and whose backward does it for the backward). Compiled and eager calls are therefore
counted, warned about and refused alike, with strict mode read when the call runs, not when it was
compiled.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import os
import threading
import warnings
from collections import Counter

import torch

__all__ = [
    "CudnnAttentionCopyWarning",
    "CudnnAttentionFallbackWarning",
    "Counters",
    "StrictModeError",
    "count_cudnn",
    "count_provider",
    "env_flag",
    "fallback_in_graph",
    "fallback_output",
    "fallback_outputs",
    "flat_stats",
    "is_strict",
    "note_copy",
    "note_fallback",
    "note_graph_build",
    "reset_stats",
    "set_strict",
    "stacklevel_past_frameworks",
    "stats",
    "strict",
]


class CudnnAttentionFallbackWarning(UserWarning):
    """A call ran on the exact PyTorch path instead of cuDNN (emitted once per reason)."""


class CudnnAttentionCopyWarning(UserWarning):
    """An input was copied before the kernel ran (its head dim is not contiguous in memory): exact, but a copy on
    every such call. Emitted once per input name; ``warnings.filterwarnings("ignore", category=...)`` silences it."""


class StrictModeError(RuntimeError):
    """Raised in strict mode where a call would otherwise fall back from cuDNN."""


_lock = threading.Lock()


@dataclasses.dataclass
class Counters:
    """Every count :func:`stats` reports, in one place: what served each call and what it cost to build."""

    cudnn: Counter = dataclasses.field(default_factory=Counter)  # direction -> calls served by cuDNN
    fallback: dict = dataclasses.field(default_factory=lambda: {"forward": Counter(), "backward": Counter()})  # direction -> reason -> n
    provider: Counter = dataclasses.field(default_factory=Counter)  # provider path served here -> n
    handed_to_torch: dict = dataclasses.field(default_factory=lambda: {"torch_forward": Counter(), "torch_backward": Counter()})
    graph_builds: Counter = dataclasses.field(default_factory=Counter)  # direction -> graphs built (or rejected)
    build_seconds: float = 0.0  # spent building cuDNN graphs, both directions

    def as_dict(self) -> dict:
        """The nested view :func:`stats` returns."""
        provider = {path: self.provider[path] for path in ("sdpa_forward", "sdpa_backward", "varlen_forward", "varlen_backward")}
        provider.update({path: dict(reasons) for path, reasons in self.handed_to_torch.items()})
        return {
            "cudnn_forward": self.cudnn["forward"],
            "cudnn_backward": self.cudnn["backward"],
            "fallback_forward": dict(self.fallback["forward"]),
            "fallback_backward": dict(self.fallback["backward"]),
            "provider": provider,
            "graph_builds": {
                "forward": self.graph_builds["forward"],
                "backward": self.graph_builds["backward"],
                "seconds": self.build_seconds,
            },
        }

    def flat(self) -> dict[str, float]:
        """One level of ``name: number`` for loggers: ``cudnn_forward``, ``fallback_forward/<reason>``,
        ``provider/sdpa_forward``, ``provider/torch_forward/<reason>``, ``graph_builds/forward``, ..."""
        flat: dict[str, float] = {}

        def walk(prefix: str, value) -> None:
            if isinstance(value, dict):
                for key, inner in value.items():
                    walk(f"{prefix}/{key}" if prefix else key, inner)
            else:
                flat[prefix] = value

        walk("", self.as_dict())
        return flat


_counters = Counters()
_warned: set[str] = set()
_strict_global: bool | None = None
_strict_scope: contextvars.ContextVar[bool | None] = contextvars.ContextVar("cudnn_attention_strict", default=None)


def count_cudnn(direction: str) -> None:
    # Counter increments are atomic enough under the GIL for a statistic; no lock on the hot path.
    _counters.cudnn[direction] += 1


def note_graph_build(direction: str, seconds: float) -> None:
    """Record one cuDNN graph build (or rejection) and its wall time: builds cost tens to hundreds of
    milliseconds each, so a run that keeps meeting new shapes pays for them step after step."""
    with _lock:
        _counters.graph_builds[direction] += 1
        _counters.build_seconds += seconds


def count_provider(path: str, reason: str | None = None) -> None:
    """Record one call that reached the :mod:`~cudnn_attention.provider` overrides.

    ``path`` is ``"sdpa_forward"``, ``"sdpa_backward"``, ``"varlen_forward"`` or ``"varlen_backward"``
    when this project's op served it, ``"torch_forward"``/``"torch_backward"`` with a ``reason`` when
    it was handed to torch's own kernel. The hand-off warns once per reason but never raises in
    strict mode: torch's kernel computes the same function, so nothing is approximated.
    """
    if reason is None:
        _counters.provider[path] += 1  # hot path: no lock, as in count_cudnn
        return
    message = f"cudnn_attention provider: handing this call to torch's own kernel: {reason}"
    _count_and_warn_once(_counters.handed_to_torch[path], reason, f"provider: {reason}", message, stacklevel=3)


def _count_and_warn_once(counter: Counter, reason: str, warned_as: str, message: str, *, stacklevel: int) -> None:
    """Count ``reason`` in ``counter``; warn with ``message`` the first time ``warned_as`` comes up, naming the first line
    at or above ``stacklevel`` (as seen from the caller) that is outside this package, torch and the frameworks that
    run models (:func:`stacklevel_past_frameworks`)."""
    with _lock:
        counter[reason] += 1
        first = warned_as not in _warned
        _warned.add(warned_as)
    if first:
        warnings.warn(message, CudnnAttentionFallbackWarning, stacklevel=stacklevel_past_frameworks(start=stacklevel + 1))


# The packages whose frames lie between a user's line and a warning about what it ran: this one, torch (module calls,
# the dispatcher's Python kernels, compiled graphs' runtime) and the frameworks that run a model for the user
# (``kernels``: transformers 5.25's hub-kernel layers wrap a model's forward). A warning names the first line outside
# them: the user's ``model(ids)`` or ``trainer.train()``, not transformers' attention layer.
_FRAMEWORKS = frozenset(
    {
        *("cudnn_attention", "torch", "contextlib", "functools"),
        *("transformers", "kernels", "accelerate", "peft", "trl", "lightning", "pytorch_lightning", "lightning_fabric"),
    }
)


def stacklevel_past_frameworks(*, start: int = 1) -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that names the first frame, ``start``
    levels up or higher, whose module is outside :data:`_FRAMEWORKS` (``start`` itself when every frame is theirs)."""
    level, frame = 1, inspect.currentframe().f_back
    while frame is not None and level < start:
        level, frame = level + 1, frame.f_back
    first = level
    while frame is not None and _in_frameworks(frame):
        level, frame = level + 1, frame.f_back
    return level if frame is not None else first


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _in_frameworks(frame) -> bool:
    if frame.f_globals.get("__name__", "").partition(".")[0] in _FRAMEWORKS:
        return True
    # A compiled graph's code runs under other module names: FX's generated forward ("<eval_with_key>.N"), and
    # inductor's wrappers, named by the torch file that generated them.
    filename = frame.f_code.co_filename
    return filename.startswith("<eval_with_key>") or filename.startswith(_TORCH_DIR)


def note_copy(name: str, message: str) -> None:
    """Warn ``message`` as a :class:`CudnnAttentionCopyWarning` the first time input ``name`` is copied since import
    (or :func:`reset_stats`), pointing at the first frame outside this package (the user's call, or the framework's
    that reached the provider or the transformers integration). A warning, not a log line: a copy on every call would
    otherwise say so on every call, and ``warnings`` filters can silence a category."""
    with _lock:
        first = f"copy: {name}" not in _warned
        _warned.add(f"copy: {name}")
    if not first:
        return
    level, frame = 1, inspect.currentframe()  # warnings.warn counts this function's frame as level 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "cudnn_attention":
        level, frame = level + 1, frame.f_back
    warnings.warn(message, CudnnAttentionCopyWarning, stacklevel=level)


def stats() -> dict:
    """How many calls each path served since import (or :func:`reset_stats`).

    Returns ``{"cudnn_forward": n, "cudnn_backward": n, "fallback_forward": {reason: n},
    "fallback_backward": {reason: n}, "provider": {...}}``. ``"provider"`` counts the calls that
    reached :func:`cudnn_attention.install`'s overrides: ``"sdpa_forward"``, ``"sdpa_backward"``,
    ``"varlen_forward"``, ``"varlen_backward"`` (served here, so also counted in ``cudnn_*``) and
    ``"torch_forward"``/``"torch_backward"`` ``{reason: n}`` (handed to torch's own kernel).
    ``"graph_builds"`` is ``{"forward": n, "backward": n, "seconds": s}``: cuDNN graphs built (or
    rejected) and the wall time spent on it. Calls replayed from a captured CUDA graph run no Python
    and are not counted. Calls in a ``torch.compile``'d graph are counted each time the graph runs, as
    eager ones are: the counting runs in the ops the graph holds (see :func:`fallback_in_graph`).
    """
    with _lock:
        return _counters.as_dict()


def flat_stats() -> dict[str, float]:
    """:func:`stats` flattened to ``name: number`` (see :meth:`Counters.flat`), for loggers."""
    with _lock:
        return _counters.flat()


def reset_stats() -> None:
    """Zero every counter and forget which fallback reasons and copied inputs already warned."""
    global _counters
    with _lock:
        _counters = Counters()
        _warned.clear()


def is_strict() -> bool:
    """Whether fallbacks raise: the innermost :func:`strict` scope, else :func:`set_strict`, else the env var.

    Not traceable (Dynamo cannot read a ``ContextVar``): compiled calls ask it from inside their graph's
    ``noted_fallback`` op, each time the graph runs (see :func:`fallback_in_graph`)."""
    scoped = _strict_scope.get()
    if scoped is not None:
        return scoped
    if _strict_global is not None:
        return _strict_global
    return env_flag("CUDNN_ATTENTION_STRICT")


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to ``1``, ``true``, ``yes`` or ``on`` (any case)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def set_strict(enabled: bool | None) -> bool | None:
    """Set strict mode process-wide; ``None`` defers to ``CUDNN_ATTENTION_STRICT`` again.

    Returns the previous process-wide setting, so a caller can put it back. Anything but ``True``, ``False`` or
    ``None`` raises ``TypeError`` naming it (``"false"`` would otherwise read as true).
    """
    global _strict_global
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_strict() takes True, False or None, got {enabled!r}")
    previous = _strict_global
    _strict_global = enabled
    return previous


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Context manager: inside it every fallback from cuDNN raises :class:`StrictModeError`, that of a
    ``torch.compile``'d call included, whenever it was compiled (the graph reads the setting as it runs).

    Example:
        >>> with cudnn_attention.strict():
        ...     out = cudnn_attention.attention(q, k, v, causal=True)  # raises if cuDNN cannot serve it
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"strict() takes True or False, got {enabled!r}")
    token = _strict_scope.set(enabled)
    try:
        yield
    finally:
        _strict_scope.reset(token)


class _CountFallbackBackward(torch.autograd.Function):
    """Identity whose backward records that the fallback served the gradient too."""

    @staticmethod
    def forward(ctx, out, reason):
        ctx.reason = reason
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        note_fallback("backward", ctx.reason)
        return grad_out, None


class _CountFallbackBackwardWithLse(torch.autograd.Function):
    """The same identity over the output and the LSE: one node, so a backward that reaches either or both is
    counted once (a loss may use the LSE alone)."""

    @staticmethod
    def forward(ctx, out, lse, reason):
        ctx.reason = reason
        ctx.set_materialize_grads(False)  # an output the loss does not use costs nothing
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        note_fallback("backward", ctx.reason)
        return grad_out, grad_lse, None


def fallback_output(out: torch.Tensor, reason: str, *, needs_grad: bool) -> torch.Tensor:
    """Arrange for the backward of a fallback output to be counted (the forward was recorded,
    and refused in strict mode, by :func:`note_fallback` before it ran)."""
    return _CountFallbackBackward.apply(out, reason) if needs_grad else out


def fallback_outputs(out: torch.Tensor, lse: torch.Tensor | None, reason: str, *, needs_grad: bool) -> tuple:
    """:func:`fallback_output` for ``(out, lse)``: the backward is counted whether it comes through the output,
    the LSE (differentiable, see :func:`cudnn_attention.attention`) or both. An LSE that needs no gradient (only V
    requires one, and the LSE does not depend on V) is left as it is."""
    if not needs_grad:
        return out, lse
    if lse is None or not lse.requires_grad:
        return _CountFallbackBackward.apply(out, reason), lse
    return _CountFallbackBackwardWithLse.apply(out, lse, reason)


def note_fallback(direction: str, reason: str, *, caller_depth: int = 1) -> None:
    """Record one call served by the fallback; raise in strict mode, warn the first time per reason
    (naming the first line, ``caller_depth`` frames above the caller or higher, outside this package, torch
    and the frameworks that run models: the user's line)."""
    if direction == "forward" and is_strict():
        raise StrictModeError(f"cudnn_attention strict mode: cuDNN cannot serve this call ({reason})")
    message = f"cudnn_attention: running the exact PyTorch path, not cuDNN: {reason}"
    _count_and_warn_once(_counters.fallback[direction], reason, reason, message, stacklevel=2 + caller_depth)


# ----------------------------------------------------------------------------------------------
# The same bookkeeping inside a compiled graph
# ----------------------------------------------------------------------------------------------

# Another fragment of the cudnn_attention namespace (cudnn_ops defines the kernels' ops there): this op belongs to the policy.
_lib = torch.library.Library("cudnn_attention", "FRAGMENT")
# A CUDA graph would replay the op without its Python, counting nothing and refusing nothing: the tag keeps
# Inductor's CUDA graphs (mode="reduce-overhead") off it. Public in the torch versions that have it (2.13 does).
_UNSAFE_IN_CUDA_GRAPHS = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None)
_lib.define("noted_fallback(Tensor out, str direction, str reason) -> Tensor", tags=_UNSAFE_IN_CUDA_GRAPHS)


def _noted_fallback(out: torch.Tensor, direction: str, reason: str) -> torch.Tensor:
    # Runs when the compiled graph runs, once per call. A copy, not ``out`` itself: an op may not return
    # an alias of its input, and an op whose result nobody uses would be dropped from the graph. One
    # pass over the output, beside a fallback that computes every query-key score.
    note_fallback(direction, reason, caller_depth=0)  # the warning names the line that called the compiled code
    return out.clone()


_lib.impl("noted_fallback", _noted_fallback, "CompositeExplicitAutograd")


@torch.library.register_fake("cudnn_attention::noted_fallback", lib=_lib)
def _noted_fallback_fake(out, direction, reason):
    return torch.empty_like(out)


def _noted_setup_context(ctx, inputs, output):
    ctx.direction, ctx.reason = inputs[1], inputs[2]


def _noted_backward(ctx, grad_out):
    if ctx.direction == "forward":
        grad_out = torch.ops.cudnn_attention.noted_fallback(grad_out, "backward", ctx.reason)
    return grad_out, None, None


torch.library.register_autograd("cudnn_attention::noted_fallback", _noted_backward, setup_context=_noted_setup_context, lib=_lib)


def fallback_in_graph(out: torch.Tensor, reason: str) -> torch.Tensor:
    """``out``, computed by the fallback while ``torch.compile`` traces, routed through an op that does
    what :func:`note_fallback` and :func:`fallback_output` do in eager, each time the compiled graph
    runs: raise in strict mode (as read at that moment), else count the forward and warn once per
    reason; its backward counts the backward. Traceable with ``fullgraph=True``: Dynamo sees one op.

    Unlike eager, a refused compiled call has computed its output before the op raises (the graph
    orders the op after the math it gates); nothing is returned either way. The warning names the
    line that called the compiled code (the graph's own frames are torch's). A CUDA graph
    captured by hand around a compiled call replays no Python at all (see :func:`stats`)."""
    return torch.ops.cudnn_attention.noted_fallback(out, "forward", reason)
