"""One reversible switch: ``F.scaled_dot_product_attention`` and ``varlen_attn`` on this project's cuDNN ops.

:func:`install` overrides the CUDA kernels of ``aten::_scaled_dot_product_cudnn_attention`` and its
backward (and of ``torch_attn::_varlen_attn``, ``_varlen_attn_out`` and ``_varlen_attn_backward``
where this torch defines them) with :mod:`cudnn_attention.sdpa_overrides`. torch's autograd
formulas stay in place; only the kernels under them change. Calls those kernels cannot serve
(attention bias, dropout, paged KV, configurations cuDNN rejects) run torch's own implementation
and are counted in ``cudnn_attention.stats()["provider"]``.

While installed it also makes the cuDNN SDPA backend reachable: torch's default backend priority
puts cuDNN last, after the math backend, which accepts every call, so without a change dense
``F.scaled_dot_product_attention`` would never reach these kernels. :func:`install` enables the
cuDNN backend (``torch.backends.cuda.enable_cudnn_sdp(True)``) and moves it to the front of the
priority order (the order ``sdpa_kernel(..., set_priority=True)`` sets; present in torch >= 2.6,
and guarded: without it only the enable flag changes). Calls the cuDNN backend refuses still go
to the next backend (flash, efficient, math) as before.
:meth:`ProviderHandle.remove` restores both settings to what they were at :func:`install`; a
change a caller makes to them in between is overwritten then. ``sdpa_kernel(...)`` blocks
inside keep working: they select among backends, and restore what they found on exit.

Example:
    >>> import cudnn_attention
    >>> with cudnn_attention.enabled():
    ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # runs cudnn_attention::forward
    >>> cudnn_attention.stats()["provider"]["sdpa_forward"]
    1

Another override of the same kernels is never won or lost silently. nvidia-cudnn-frontend's own
provider (``cudnn.torch``: ``activate_flash_attention_impl("CUDNN")``, or torch's
``enable_cudnn_sdp_python``) overrides the same five kernels; :func:`install` finds any kernel
registered over torch's at the ``CUDA`` key by someone else and raises
:class:`ProviderConflictError` naming it, or with ``replace_existing=True`` shadows it with a
:class:`ProviderConflictWarning` (``remove()`` brings it back). A provider registered over this
one after :func:`install` shows in :meth:`ProviderHandle.shadowed_by`, and the next
:func:`install` or :func:`enabled` says so the same way.

torch's own switch to the frontend's kernels (``torch.backends.cuda.enable_cudnn_sdp_python``,
``TORCH_CUDNN_SDPA_USE_PYTHON=1``; on torch's main branch after 2.15) is found by attribute, so any
torch works: while it is on, :func:`install` raises :class:`ProviderConflictError` saying what each
would serve, or with ``replace_existing=True`` turns the switch off (its kernels go, rather than
lie under ours) and ``remove()`` turns it back on. Either way one of the two owns each kernel.

Installing is explicit; importing this module changes nothing. Where torch has
``torch.nn.attention.register_flash_attention_impl``, :func:`register_with_torch` offers the same
switch as ``torch.nn.attention.activate_flash_attention_impl("CUDNN_ATTENTION_PROJECT")``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import torch

from . import _compat, sdpa_overrides, validation
from .policy import stacklevel_past_frameworks

__all__ = [
    "TORCH_REGISTRY_NAME",
    "ProviderConflictError",
    "ProviderConflictWarning",
    "ProviderHandle",
    "ProviderUnusedWarning",
    "current",
    "enabled",
    "install",
    "register_with_torch",
]

# Not upstream's "CUDNN" (nvidia-cudnn-frontend's provider), so both can be registered side by side.
TORCH_REGISTRY_NAME = "CUDNN_ATTENTION_PROJECT"

_DISPATCH_KEY = "CUDA"
_DENSE_KERNELS = {
    "_scaled_dot_product_cudnn_attention": sdpa_overrides.sdpa_forward,
    "_scaled_dot_product_cudnn_attention_backward": sdpa_overrides.sdpa_backward,
}
_VARLEN_OPS = ("_varlen_attn", "_varlen_attn_out", "_varlen_attn_backward")

_lock = threading.RLock()
_live: ProviderHandle | None = None


class ProviderConflictError(RuntimeError):
    """Another provider (e.g. nvidia-cudnn-frontend's ``cudnn.torch``) overrides the kernels :func:`install` would override."""


class ProviderConflictWarning(UserWarning):
    """:func:`install` with ``replace_existing=True`` shadows another provider's kernels until :meth:`ProviderHandle.remove`."""


class ProviderUnusedWarning(UserWarning):
    """:func:`install` on a machine without a CUDA device: its kernels are CUDA kernels, so no call reaches them."""


class ProviderHandle:
    """One installation of the overrides; :meth:`remove` undoes all of it (idempotent)."""

    def __init__(self, kernels: dict[str, dict], libraries: list, sdp_state: tuple[bool, list | None], *, torch_switch_was_on=False):
        self._kernels = kernels  # namespace -> {op name: kernel}, to register again on top
        self._libraries = libraries
        self._sdp_state = sdp_state
        self._torch_switch_was_on = torch_switch_was_on  # install() turned torch's switch off; remove() turns it on

    @property
    def active(self) -> bool:
        """Whether the overrides of this handle are still registered (see :meth:`shadowed_by` for whether they run)."""
        return bool(self._libraries)

    @property
    def overridden_ops(self) -> list[str]:
        """``"namespace::op"`` of every kernel this handle overrides (empty once removed)."""
        return _qualified_names(self._kernels) if self._libraries else []

    def shadowed_by(self) -> dict[str, str]:
        """``{op: "path:line"}`` for each kernel of this handle another provider registered over after it was installed.

        Those calls run the other provider's kernel, not this one; empty while this handle serves
        every op (and once removed). :func:`install` raises on it, or registers on top again.
        """
        return _other_overrides(self.overridden_ops)

    def remove(self) -> None:
        """Deregister the kernels (the ones they shadowed come back) and restore the SDP backend settings."""
        global _live
        with _lock:
            if not self._libraries:
                return
            for library in self._libraries:
                _compat.destroy_library(library)
            self._libraries = []
            _restore_sdp_state(self._sdp_state)
            if _live is self:
                _live = None
            if self._torch_switch_was_on:
                self._torch_switch_was_on = False
                _set_torch_switch(True)
        _forget_in_torch_registry()

    def _register_on_top(self) -> None:
        for library in self._libraries:
            _compat.destroy_library(library)
        self._libraries = _register_all(self._kernels)

    def __repr__(self) -> str:
        return f"ProviderHandle(active={self.active}, ops={self.overridden_ops})"


def current() -> ProviderHandle | None:
    """The live handle, or ``None`` when the provider is not installed."""
    return _live


def install(*, replace_existing: bool = False) -> ProviderHandle:
    """Serve torch's cuDNN SDPA (and varlen) ops from this project's ops; idempotent.

    Returns the live :class:`ProviderHandle`: a second call while installed returns the same
    handle and registers nothing again. See the module docstring for the SDP backend settings.

    Args:
        replace_existing: What to do when another provider already overrides these kernels
            (nvidia-cudnn-frontend's ``cudnn.torch``, say). ``False`` (default): raise
            :class:`ProviderConflictError` naming it, and change nothing. ``True``: register over
            it with a :class:`ProviderConflictWarning` naming it; ``remove()`` brings it back.
            Also applies when one was registered over a live installation: ``True`` puts this
            provider back on top. torch's ``enable_cudnn_sdp_python`` switch, when on, is turned
            off instead of shadowed (and back on by ``remove()``).
    """
    global _live
    replace_existing = validation.check_flag(replace_existing, "replace_existing")
    with _lock:
        if _live is not None:
            over_ours = _live.shadowed_by()
            if over_ours:
                _report_conflict(over_ours, over_ours=True, replace_existing=replace_existing)
                _live._register_on_top()
            return _live
        if not torch.cuda.is_available():
            # Installed all the same (a CPU build registers the kernels; tests and CPU-side setup rely on it), but a run
            # that believes it is on cuDNN would otherwise learn nothing: calls on CPU tensors never reach these kernels.
            warnings.warn(
                "cudnn_attention.install(): this machine has no CUDA device, and the provider's kernels are CUDA kernels: "
                "F.scaled_dot_product_attention and varlen_attn on CPU tensors keep running torch's own kernels, uncounted "
                "(stats()['provider'] stays 0); for the counted exact path call cudnn_attention.attention() or use "
                "attn_implementation='cudnn'",
                ProviderUnusedWarning,
                stacklevel=stacklevel_past_frameworks(start=2),
            )
        kernels = {"aten": dict(_DENSE_KERNELS), "torch_attn": _varlen_kernels()}
        torch_switch_on = _torch_switch_on()
        if torch_switch_on:
            # Before the registrations are read: the switch is what to turn off (turned off, its kernels go; shadowed,
            # torch would still report it on while ours serve).
            _report_torch_switch(replace_existing=replace_existing)
            _set_torch_switch(False)
        existing = _other_overrides(_qualified_names(kernels))
        if existing:
            _report_conflict(existing, over_ours=False, replace_existing=replace_existing)
        sdpa_overrides.lse_has_trailing_one = _aten_lse_has_trailing_one()
        libraries = _register_all(kernels)
        _live = ProviderHandle(kernels, libraries, _prefer_cudnn_sdp(), torch_switch_was_on=torch_switch_on)
        return _live


@contextlib.contextmanager
def enabled(*, replace_existing: bool = False):
    """Context manager: :func:`install` on entry, remove on exit (also when the block raises).

    An installation that was already live on entry (an outer :func:`install`, another
    ``enabled()``, a Lightning callback) is left in place on exit: this block did not make it.
    ``replace_existing`` is :func:`install`'s.

    Example:
        >>> with cudnn_attention.enabled():
        ...     loss = model(batch).loss  # every cuDNN-backend SDPA call runs cudnn_attention::forward
        ...     loss.backward()
    """
    owner = current() is None
    handle = install(replace_existing=replace_existing)
    try:
        yield handle
    finally:
        if owner:
            handle.remove()


def register_with_torch() -> bool:
    """Offer :func:`install` to ``torch.nn.attention``'s flash-attention registry as ``"CUDNN_ATTENTION_PROJECT"``.

    Then ``torch.nn.attention.activate_flash_attention_impl("CUDNN_ATTENTION_PROJECT")`` installs
    the provider and ``restore_flash_attention_impl()`` removes it: the registry holds the same
    handle as :func:`current`, so there is one record of whether the provider is on. Idempotent;
    returns ``False`` on a torch without the registry (use :func:`install` there). Explicit rather
    than at import: torch has no way to unregister a name.
    """
    register = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if register is None:
        return False
    register(TORCH_REGISTRY_NAME, register_fn=install)
    return True


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _register_all(kernels: dict[str, dict]) -> list:
    return [_register(namespace, ops) for namespace, ops in kernels.items() if ops]


def _register(namespace: str, kernels: dict) -> torch.library.Library:
    library = torch.library.Library(namespace, "IMPL")
    with warnings.catch_warnings():
        # A CUDA build warns that we shadow its kernel; shadowing it is the point, and remove() restores it.
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        for name, kernel in kernels.items():
            _compat.impl_over(library, name, kernel, _DISPATCH_KEY)
    return library


def _qualified_names(kernels: dict[str, dict]) -> list[str]:
    return sorted(f"{namespace}::{name}" for namespace, ops in kernels.items() for name in ops)


def _varlen_kernels() -> dict:
    """The kernels for the ``torch_attn`` varlen ops this torch defines: none in 2.9 (no varlen API), no ``_out`` in 2.10."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return {}
    namespace = torch.ops.torch_attn
    # hasattr on an op namespace is True only for ops that exist (torch.ops itself accepts any name).
    present = [name for name in _VARLEN_OPS if hasattr(namespace, name) and hasattr(varlen, name)]
    return sdpa_overrides.varlen_kernels(
        schemas={name: _compat.op_schema(getattr(namespace, name)) for name in present},
        torch_kernels={name: _compat.custom_op_body(getattr(varlen, name)) for name in present},
    )


# ----------------------------------------------------------------------------------------------
# Other providers of the same kernels
# ----------------------------------------------------------------------------------------------


def _other_overrides(ops: list[str]) -> dict[str, str]:
    """``{op: "path:line"}`` for each op whose running kernel at the CUDA key someone else registered.

    torch's own kernels (C++ sources, or Python files inside torch) and this module's are not
    counted; a kernel any other Python code registered with ``torch.library`` is: the dispatcher
    records where each registration was made, and runs the newest.
    """
    found = {}
    for op in ops:
        registrations = _compat.kernel_registrations(op, _DISPATCH_KEY)
        if registrations and _registered_by(registrations[0]) == "other":
            found[op] = registrations[0]
    return found


def _registered_by(where: str) -> str:
    path = where.rpartition(":")[0] or where
    if os.path.realpath(path) == os.path.realpath(__file__):
        return "us"
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    if path.endswith((".cpp", ".cc", ".cu", ".h")) or os.path.realpath(path).startswith(torch_dir + os.sep):
        return "torch"
    return "other"


def _describe(path: str) -> str:
    if _torch_switch_on():
        return f"the kernels of torch's switch {_TORCH_SWITCH}, which is on (registered at {path})"
    if "cudnn/torch/" in path.replace(os.sep, "/"):
        return f"nvidia-cudnn-frontend's provider (cudnn.torch, {path})"
    return f"kernels registered at {path}"


# ----------------------------------------------------------------------------------------------
# torch's own switch to the frontend's kernels
# ----------------------------------------------------------------------------------------------

_TORCH_SWITCH = "torch.backends.cuda.enable_cudnn_sdp_python"
# What each of the two serves: the same five kernels, by different code.
_THEIRS_SERVE = (
    "nvidia-cudnn-frontend's kernels serve F.scaled_dot_product_attention on torch's cuDNN backend and varlen_attn, "
    "handing what they decline to torch's C++ kernels"
)
_OURS_SERVE = (
    "cudnn_attention's would serve the same calls on its own kernels, hand the same to torch's and count each in stats()['provider']"
)


def _torch_switch_on() -> bool:
    """Whether torch's ``enable_cudnn_sdp_python`` switch is on; False on a torch without it (found by attribute: the
    switch is on torch's main branch, after 2.15)."""
    enabled = getattr(torch.backends.cuda, "cudnn_sdp_python_enabled", None)
    return bool(enabled()) if enabled is not None else False


def _set_torch_switch(enabled: bool) -> None:
    # Reached where _torch_switch_on() found the switch, an attribute of torch's main branch only; a switch gone since
    # (a stand-in taken away) has nothing left to turn back on.
    switch = getattr(torch.backends.cuda, "enable_cudnn_sdp_python", None)
    if switch is not None:
        switch(enabled)


def _report_torch_switch(*, replace_existing: bool) -> None:
    """Raise :class:`ProviderConflictError` saying what torch's switch and this provider would each serve, or warn that
    the switch is turned off (``replace_existing``)."""
    how = f"{_TORCH_SWITCH}(True) or TORCH_CUDNN_SDPA_USE_PYTHON=1"
    situation = f"torch's cuDNN Python switch is on ({how}): {_THEIRS_SERVE}; {_OURS_SERVE}."
    if replace_existing:
        message = f"{situation} The switch is turned off until remove(); cudnn_attention's kernels serve meanwhile."
        warnings.warn(message, ProviderConflictWarning, stacklevel=3)
        return
    raise ProviderConflictError(
        f"{situation} Only one can own them: turn torch's switch off ({_TORCH_SWITCH}(False), or unset "
        "TORCH_CUDNN_SDPA_USE_PYTHON), or call cudnn_attention.install(replace_existing=True), which turns it off until remove()."
    )


def _report_conflict(found: dict[str, str], *, over_ours: bool, replace_existing: bool) -> None:
    """Raise :class:`ProviderConflictError` naming who else overrides ``found``, or warn when replacing."""
    by_path: dict[str, list[str]] = {}
    for op, where in found.items():
        by_path.setdefault(where.rpartition(":")[0] or where, []).append(op)
    who = "; ".join(f"{_describe(path)} over {', '.join(ops)}" for path, ops in by_path.items())
    if over_ours:
        situation = f"cudnn_attention's provider is installed, but another provider was registered over it since: {who}."
    else:
        situation = f"torch's cuDNN attention kernels are already overridden by another provider: {who}."
    if replace_existing:
        warnings.warn(
            f"{situation} cudnn_attention's kernels now run over it; remove() brings it back.", ProviderConflictWarning, stacklevel=3
        )
        return
    raise ProviderConflictError(
        f"{situation}\nTurn that provider off first (torch.nn.attention.restore_flash_attention_impl(), "
        "torch.backends.cuda.enable_cudnn_sdp_python(False), or its handle's remove()), or call "
        "cudnn_attention.install(replace_existing=True) to run this one over it until remove()."
    )


# ----------------------------------------------------------------------------------------------
# SDP backend settings and torch's registry
# ----------------------------------------------------------------------------------------------


def _aten_lse_has_trailing_one() -> bool:
    """Ask this torch's meta kernel for the dense logsumexp's rank: (B, H, S, 1) in 2.13, (B, H, S) in some releases."""
    q = torch.empty((1, 1, 1, 8), dtype=torch.bfloat16, device="meta")
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)[1].dim() == 4


def _prefer_cudnn_sdp() -> tuple[bool, list | None]:
    """Enable the cuDNN SDP backend and put it first; return the settings to restore."""
    was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    order = _compat.sdp_priority_order()
    if order is not None:
        cudnn = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
        _compat.set_sdp_priority_order([cudnn] + [backend for backend in order if backend != cudnn])
    return was_enabled, order


def _restore_sdp_state(state: tuple[bool, list | None]) -> None:
    was_enabled, order = state
    torch.backends.cuda.enable_cudnn_sdp(was_enabled)
    if order is not None:
        _compat.set_sdp_priority_order(order)


def _forget_in_torch_registry() -> None:
    # If activate_flash_attention_impl installed us, the registry still names us as active after a
    # direct remove(); restoring there calls remove() on the (already removed) handle, a no-op.
    current_impl = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    if current_impl is not None and current_impl() == TORCH_REGISTRY_NAME:
        torch.nn.attention.restore_flash_attention_impl()
