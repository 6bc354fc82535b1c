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
priority order (``torch._C._get/_set_sdp_priority_order``, which ``sdpa_kernel(..., set_priority=True)``
uses; present in torch >= 2.6, and guarded: without it only the enable flag changes). Calls the
cuDNN backend refuses still go to the next backend (flash, efficient, math) as before.
:meth:`ProviderHandle.remove` restores both settings to what they were at :func:`install`; a
change a caller makes to them in between is overwritten then. ``sdpa_kernel(...)`` blocks
inside keep working: they select among backends, and restore what they found on exit.

Example:
    >>> import cudnn_attention
    >>> with cudnn_attention.enabled():
    ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # runs cudnn_attention::forward
    >>> cudnn_attention.stats()["provider"]["sdpa_forward"]
    1

Installing is explicit; importing this module changes nothing. Where torch has
``torch.nn.attention.register_flash_attention_impl``, :func:`register_with_torch` offers the same
switch as ``torch.nn.attention.activate_flash_attention_impl("CUDNN_ATTENTION_PROJECT")``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from . import sdpa_overrides

__all__ = ["TORCH_REGISTRY_NAME", "ProviderHandle", "current", "enabled", "install", "register_with_torch"]

# Not upstream's "CUDNN" (nvidia-cudnn-frontend's provider), so both can be registered side by side.
TORCH_REGISTRY_NAME = "CUDNN_ATTENTION_PROJECT"

_DENSE_KERNELS = {
    "_scaled_dot_product_cudnn_attention": sdpa_overrides.sdpa_forward,
    "_scaled_dot_product_cudnn_attention_backward": sdpa_overrides.sdpa_backward,
}
_VARLEN_KERNELS = {
    "_varlen_attn": sdpa_overrides.varlen_forward,
    "_varlen_attn_out": sdpa_overrides.varlen_forward_out,
    "_varlen_attn_backward": sdpa_overrides.varlen_backward,
}

_lock = threading.RLock()
_live: ProviderHandle | None = None


class ProviderHandle:
    """One installation of the overrides; :meth:`remove` undoes all of it (idempotent)."""

    def __init__(self, libraries: list, sdp_state: tuple[bool, list | None]):
        self._libraries = libraries
        self._sdp_state = sdp_state

    @property
    def active(self) -> bool:
        """Whether the overrides of this handle are still registered."""
        return bool(self._libraries)

    @property
    def overridden_ops(self) -> list[str]:
        """``"namespace::op"`` of every kernel this handle overrides (empty once removed)."""
        return sorted(key.replace("/CUDA", "").replace("/", "::", 1) for lib in self._libraries for key in lib._op_impls)

    def remove(self) -> None:
        """Deregister the kernels (torch's own come back) and restore the SDP backend settings."""
        global _live
        with _lock:
            if not self._libraries:
                return
            for library in self._libraries:
                library._destroy()  # the dispatcher drops our kernels; the ones they shadowed return
            self._libraries = []
            _restore_sdp_state(self._sdp_state)
            if _live is self:
                _live = None
        _forget_in_torch_registry()

    def __repr__(self) -> str:
        return f"ProviderHandle(active={self.active}, ops={self.overridden_ops})"


def current() -> ProviderHandle | None:
    """The live handle, or ``None`` when the provider is not installed."""
    return _live


def install() -> ProviderHandle:
    """Serve torch's cuDNN SDPA (and varlen) ops from this project's ops; idempotent.

    Returns the live :class:`ProviderHandle`: a second call while installed returns the same
    handle and registers nothing again. See the module docstring for the SDP backend settings.
    """
    global _live
    with _lock:
        if _live is not None:
            return _live
        sdpa_overrides.lse_has_trailing_one = _aten_lse_has_trailing_one()
        libraries = [_register("aten", _DENSE_KERNELS)]
        varlen = _varlen_kernels()
        if varlen:
            libraries.append(_register("torch_attn", varlen))
        _live = ProviderHandle(libraries, _prefer_cudnn_sdp())
        return _live


@contextlib.contextmanager
def enabled():
    """Context manager: :func:`install` on entry, remove on exit (also when the block raises).

    An installation that was already live on entry (an outer :func:`install`, another
    ``enabled()``, a Lightning callback) is left in place on exit: this block did not make it.

    Example:
        >>> with cudnn_attention.enabled():
        ...     loss = model(batch).loss  # every cuDNN-backend SDPA call runs cudnn_attention::forward
        ...     loss.backward()
    """
    owner = current() is None
    handle = install()
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


def _register(namespace: str, kernels: dict) -> torch.library.Library:
    library = torch.library.Library(namespace, "IMPL")
    with warnings.catch_warnings():
        # A CUDA build warns that we shadow its kernel; shadowing it is the point, and remove() restores it.
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        for name, kernel in kernels.items():
            library.impl(name, kernel, "CUDA")
    return library


def _varlen_kernels() -> dict:
    """The ``torch_attn`` varlen ops this torch defines (none before torch's varlen API existed)."""
    try:
        import torch.nn.attention.varlen
    except ImportError:
        return {}
    namespace = torch.ops.torch_attn
    # hasattr on an op namespace is True only for ops that exist (torch.ops itself accepts any name).
    return {name: kernel for name, kernel in _VARLEN_KERNELS.items() if hasattr(namespace, name)}


def _aten_lse_has_trailing_one() -> bool:
    """Ask this torch's meta kernel for the dense logsumexp's rank: (B, H, S, 1) in 2.13, (B, H, S) in some releases."""
    q = torch.empty((1, 1, 1, 8), dtype=torch.bfloat16, device="meta")
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)[1].dim() == 4


def _prefer_cudnn_sdp() -> tuple[bool, list | None]:
    """Enable the cuDNN SDP backend and put it first; return the settings to restore."""
    was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    order = None
    if hasattr(torch._C, "_get_sdp_priority_order") and hasattr(torch._C, "_set_sdp_priority_order"):
        order = [int(backend) for backend in torch._C._get_sdp_priority_order()]
        cudnn = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
        torch._C._set_sdp_priority_order([cudnn] + [backend for backend in order if backend != cudnn])
    return was_enabled, order


def _restore_sdp_state(state: tuple[bool, list | None]) -> None:
    was_enabled, order = state
    torch.backends.cuda.enable_cudnn_sdp(was_enabled)
    if order is not None:
        torch._C._set_sdp_priority_order(order)


def _forget_in_torch_registry() -> None:
    # If activate_flash_attention_impl installed us, the registry still names us as active after a
    # direct remove(); restoring there calls remove() on the (already removed) handle, a no-op.
    current_impl = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    if current_impl is not None and current_impl() == TORCH_REGISTRY_NAME:
        torch.nn.attention.restore_flash_attention_impl()
