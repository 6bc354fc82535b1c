"""Every touch of a private torch or cuDNN frontend API, in one place.

Each function names the private attribute it reaches, the version it was checked against, and what
replaces it when it moves. Nothing else in the package reaches into private APIs: when torch or the
cuDNN frontend move one, this module is the only file to change. transformers' and Lightning's private
attributes are the integrations' to touch, each in its own compat module
(:mod:`cudnn_attention.integrations.hf._compat`, :mod:`cudnn_attention.integrations.lightning._compat`).
"""

from __future__ import annotations

import re

import torch
from torch.fx import _symbolic_trace  # loaded by `import torch` already

__all__ = [
    "assert_on_device",
    "autograd_apply",
    "backend_operand_uids",
    "current_raw_stream",
    "custom_op_body",
    "destroy_library",
    "execute_lowered",
    "execute_pointer_array",
    "flop_registry",
    "fx_symbolic_tracing",
    "holds_values",
    "impl_over",
    "kernel_registrations",
    "lowered_plan",
    "op_schema",
    "parse_schema",
    "plain_dispatch",
    "sdp_priority_order",
    "selected_plan_name",
    "set_sdp_priority_order",
    "tensor_version",
]


# ----------------------------------------------------------------------------------------------
# torch
# ----------------------------------------------------------------------------------------------


def plain_dispatch() -> bool:
    """No torch dispatch mode (FakeTensorMode, functionalization, debug modes) and no functorch
    transform is active: an eager call may skip the dispatcher and see the same result.

    ``torch._C._len_torch_dispatch_stack`` and ``torch._C._are_functorch_transforms_active``:
    checked against torch 2.9-2.13; when either moves, answer False (the op path serves every case)."""
    try:
        return not torch._C._len_torch_dispatch_stack() and not torch._C._are_functorch_transforms_active()
    except AttributeError:
        return False


def autograd_apply(function: type):
    """``function.apply`` without its Python layer: ``torch._C._FunctionBase.apply`` bound to ``function``.

    Up to torch 2.13, ``torch.autograd.Function.apply`` is a Python classmethod that first binds the
    arguments to ``forward``'s signature when the class defines ``setup_context`` and unwraps dead functorch
    wrappers, then calls this; from 2.14 on, ``apply`` is this C method itself, and the two are one. Callers
    use it only where :func:`plain_dispatch` holds (no functorch transform) for a class without
    ``setup_context``, so both steps are no-ops there; skipping them saves about a quarter of ``apply``.
    A dead wrapper is no concern either: it has no storage, and the callers read every tensor's
    ``data_ptr()`` first, which raises for one. When the C apply moves, ``function.apply`` serves."""
    descriptor = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")
    return function.apply if descriptor is None else descriptor.__get__(None, function)


# The dispatcher, as the provider sees it: op schemas, who registered which kernel, SDP backend order.


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Queue a device-side assertion of a one-element bool tensor (``torch._assert_async``, 2.9-2.15):
    no host read; a false value stops the process at the next synchronization, before later kernels
    run. No public equivalent."""
    torch._assert_async(condition, message)


def tensor_version(t: torch.Tensor) -> int | None:
    """``t._version``, the counter every in-place write bumps (torch 2.9-2.15; autograd's saved-tensor
    check reads it), or None for an inference tensor, which tracks none (reading it raises)."""
    try:  # cheaper than asking t.is_inference() first on every call
        return t._version
    except RuntimeError:
        return None


def op_schema(packet) -> torch.FunctionSchema:
    """The schema of an op packet's (``torch.ops.ns.name``) default overload, as the dispatcher holds it.

    ``OpOverload._schema``: checked against torch 2.9-2.15 (run on 2.13). When it moves, parse the
    ``schema:`` line of ``torch._C._dispatch_dump(name)`` with :func:`parse_schema`."""
    return packet.default._schema


def flop_registry() -> dict:
    """``torch.utils.flop_counter``'s table of formulas, op packet -> formula, which ``FlopCounterMode`` copies when it
    is built (``register_flop_formula`` adds to it, and refuses a packet already there).

    ``torch.utils.flop_counter.flop_registry``, a module global outside its ``__all__``: checked against torch 2.9-2.15
    (run on 2.13 and 2.15). When it moves, ``FlopCounterMode(custom_mapping=...)`` takes the same formulas per counter."""
    import torch.utils.flop_counter

    return torch.utils.flop_counter.flop_registry


def holds_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read: not a meta tensor, nor a fake one (``torch.compile``'s tracing, FakeTensorMode).

    ``torch._subclasses.fake_tensor.is_fake`` (a FakeTensor, or a functional wrapper around one): checked against torch
    2.9-2.15. When it moves, ``isinstance(t, torch._subclasses.FakeTensor)`` covers the common case."""
    if t.device.type == "meta":
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:
        return True
    return not is_fake(t)


def parse_schema(text: str) -> torch.FunctionSchema:
    """A schema string (``"ns::op(Tensor query, ...) -> Tensor"``) as the dispatcher would hold it.

    ``torch._C.parse_schema``: checked against torch 2.13 (unchanged since 1.x). When it moves,
    ``torchgen.model.FunctionSchema.parse`` (shipped with torch) reads the same text."""
    return torch._C.parse_schema(text)


_REGISTRATION = re.compile(r"^(?P<key>[A-Za-z0-9_]+)(?P<inactive> \(inactive\))?: registered at (?P<where>.+?) :: ")


def kernel_registrations(qualified_name: str, dispatch_key: str) -> list[str]:
    """Where each kernel of ``qualified_name`` at ``dispatch_key`` was registered (``"path:line"``): the
    one the dispatcher runs first, then the ones it shadows, newest first. Empty when there is none.

    ``torch._C._dispatch_dump``, whose ``"CUDA: registered at PATH:LINE :: ..."`` and ``"CUDA
    (inactive): registered at ..."`` lines were checked against torch 2.13 (same format since 1.x).
    A Python kernel's PATH:LINE is its ``Library.impl`` call. When the format moves,
    ``torch._C._dispatch_has_kernel_for_dispatch_key`` still says whether a kernel is there, not whose."""
    found = []
    for line in torch._C._dispatch_dump(qualified_name).splitlines():
        match = _REGISTRATION.match(line)
        if match and match["key"] == dispatch_key:
            found.append(match["where"])
    return found


def impl_over(library: torch.library.Library, name: str, kernel, dispatch_key: str) -> None:
    """``library.impl(name, kernel, dispatch_key)`` even where another Python library (the frontend's
    ``cudnn.torch``) already registered one: :func:`cudnn_attention.install` has decided to run over it
    (it refuses, or warns, before calling this), and the dispatcher restores the other one on removal.

    ``Library.impl(..., allow_override=True)`` where torch has it; elsewhere (seen on torch 2.11 on an
    H200) ``torch.library._impls``, the set ``impl`` refuses to register over, loses the entry first."""
    try:
        library.impl(name, kernel, dispatch_key, allow_override=True)
    except TypeError:  # no allow_override in this torch
        torch.library._impls.discard(f"{library.ns}/{name.split('::')[-1]}/{dispatch_key}")
        library.impl(name, kernel, dispatch_key)


def destroy_library(library: torch.library.Library) -> None:
    """Deregister every kernel ``library`` registered; the ones they shadowed run again.

    ``Library._destroy``: checked against torch 2.9-2.15 (run on 2.13). When it moves, dropping the
    last reference does the same (``Library.__init__`` registers it as a ``weakref.finalize``)."""
    library._destroy()


def custom_op_body(op_def):
    """The Python function a ``torch.library.custom_op`` was defined with (torch's own kernel for it).

    ``CustomOpDef._init_fn``: checked against torch 2.10-2.15 (run on 2.13). When it moves, the same
    function is the op's ``CompositeExplicitAutograd`` kernel, reachable with
    ``torch._C._dispatch_get_computed_kernel_for_dispatch_key``."""
    return op_def._init_fn


def sdp_priority_order() -> list[int] | None:
    """torch's SDP backend priority (``SDPBackend`` values, first tried first); None on a torch without it.

    ``torch._C._get_sdp_priority_order``: added in torch 2.6, checked against 2.9-2.15 (run on 2.13).
    When it moves, ``torch.nn.attention.sdpa_kernel(backends, set_priority=True)`` sets the same
    order for one block (public, but scoped)."""
    getter = getattr(torch._C, "_get_sdp_priority_order", None)
    return None if getter is None else [int(backend) for backend in getter()]


def set_sdp_priority_order(order: list[int]) -> None:
    """Set what :func:`sdp_priority_order` returns (``torch._C._set_sdp_priority_order``, as there)."""
    torch._C._set_sdp_priority_order(order)


def fx_symbolic_tracing() -> bool:
    """Whether ``torch.fx.symbolic_trace`` is tracing the caller, torch.compile and torch.export excepted (ask
    ``torch.compiler.is_compiling()`` for those).

    ``torch.fx._symbolic_trace.is_fx_symbolic_tracing``, which every supported torch has (2.9 to 2.15 checked);
    elsewhere the state it reads: a thread-local behind ``_get_is_fx_tracing()`` (2.14, 2.15) or the module flag
    ``_is_fx_tracing_flag`` (1.13 to 2.13), never ``is_fx_tracing``, which logs a warning the first time it is
    asked. No public equivalent: transformers asks ``isinstance(tensor, torch.fx.Proxy)`` of a tensor instead."""
    asker = getattr(_symbolic_trace, "is_fx_symbolic_tracing", None)
    if asker is not None:
        return asker()
    getter = getattr(_symbolic_trace, "_get_is_fx_tracing", None)
    flag = getter() if getter is not None else _symbolic_trace._is_fx_tracing_flag
    return bool(flag) and not torch.compiler.is_compiling()


def current_raw_stream(device_index: int) -> int:
    """torch's current CUDA stream as a raw handle, without building a ``torch.cuda.Stream`` object
    (about 1 us cheaper per call). ``torch._C._cuda_getCurrentRawStream``: torch 2.9-2.13; the public
    replacement is ``torch.cuda.current_stream(device_index).cuda_stream``."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return getter(device_index)


# ----------------------------------------------------------------------------------------------
# cuDNN frontend (nvidia-cudnn-frontend)
# ----------------------------------------------------------------------------------------------

# Checked against nvidia-cudnn-frontend 1.32 (the pin in pyproject.toml). Executing the lowered
# backend plan with raw pointers costs about 9 us per call on an H200 against 12-17 us for the public
# ``pygraph.execute``; when these attributes move, lowered_plan() answers None and the public path runs
# (backend_operand_uids() answers None and the uid-map launch runs).


def lowered_plan(graph):
    """``(lowered graph, plan index)`` to execute ``graph``'s selected plan with raw pointers, or None.
    Reaches ``pygraph._lowered_graph``, ``._materialize_backend_plan``, ``._plan_index``, ``._plans`` and
    the lowered graph's ``_execute_plan_at_index``."""
    lowered = getattr(graph, "_lowered_graph", None)
    if lowered is None or not hasattr(lowered, "_execute_plan_at_index") or not getattr(graph, "_plans", None):
        return None
    plan = graph._materialize_backend_plan(graph._plan_index)
    if plan is None or plan.cpp_index is None:
        return None
    return lowered, plan.cpp_index


def execute_lowered(lowered, pointers: dict, workspace_ptr: int, cpp_index: int, backend_handle) -> None:
    """Run a plan from :func:`lowered_plan` with ``{uid: data_ptr}`` (``_execute_plan_at_index``, 1.32)."""
    lowered._execute_plan_at_index(pointers, workspace_ptr, cpp_index, backend_handle, None, None, None)


def backend_operand_uids(graph) -> tuple[int, ...] | None:
    """The uids of the operands the backend plan takes, in the order it keeps them (ascending), or None
    when the lowered graph does not say. ``pygraph._variant_pack_uids`` (1.32; it asks the lowered graph's
    ``_prepare_variant_pack_template`` and ``_get_variant_pack_uids_sorted``); the frontend's own execute
    hands :func:`execute_pointer_array` the same order."""
    if not hasattr(getattr(graph, "_lowered_graph", None), "_execute_with_raw_ptrs"):
        return None
    try:
        uids = graph._variant_pack_uids()
    except Exception:  # noqa: BLE001 - a frontend without it: the uid-map path serves
        return None
    return tuple(uids) if uids else None


def execute_pointer_array(lowered, pointers, workspace_ptr: int, cpp_index: int, backend_handle) -> None:
    """Run a plan from :func:`lowered_plan` with ``pointers``, an ``array.array("Q")`` of device pointers in
    :func:`backend_operand_uids` order (``_execute_with_raw_ptrs(address, count, workspace, handle, plan)``,
    1.32: what ``pygraph.execute`` calls itself, without building a uid map for C++ to sort)."""
    lowered._execute_with_raw_ptrs(pointers.buffer_info()[0], len(pointers), workspace_ptr, backend_handle, cpp_index)


def selected_plan_name(graph) -> str:
    """The engine plan ``graph`` runs (``pygraph._plan_index``, 1.32; public ``get_plan_name_at_index``)."""
    return graph.get_plan_name_at_index(getattr(graph, "_plan_index", 0))
