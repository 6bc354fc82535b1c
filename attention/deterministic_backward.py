"""One call's backward under deterministic algorithms, whatever the global setting says.

The cuDNN backward graph is picked for ``torch.are_deterministic_algorithms_enabled()`` as it reads when
the backward runs (see :class:`cudnn_attention.cudnn_ops._EagerAttention`), and the exact path's torch ops
read the same flag. FlashAttention asks per call (``deterministic=True``); :func:`with_deterministic_backward`
gives that call's backward the flag, and no other op: the call's own autograd graph is built inside an
autograd function whose backward differentiates it with the flag set, then puts the setting back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["deterministic_algorithms", "with_deterministic_backward"]


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` for the block, then the setting as it was.

    ``warn_only``: an op without a deterministic implementation inside the block (on the exact path, a CUDA
    matmul without ``CUBLAS_WORKSPACE_CONFIG``) warns that it is not deterministic instead of failing a call the
    caller asked to be made deterministic where it can be. The flag is process-wide, so another thread's ops
    running meanwhile see it too. Already on: the block changes nothing.
    """
    if torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False, warn_only=warn_only)


class _DeterministicBackward(torch.autograd.Function):
    """``compute(*inputs)`` with its backward run under :func:`deterministic_algorithms`.

    The forward builds ``compute``'s own graph on detached aliases of the inputs (no copies); the backward
    differentiates that graph with ``torch.autograd.grad``, the way reentrant activation checkpointing does,
    and frees it as any backward frees its graph (so a second backward through it raises, as torch's would
    without ``retain_graph``)."""

    @staticmethod
    def forward(ctx, compute, *inputs):
        leaves = tuple(None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs)
        with torch.enable_grad():
            outputs = compute(*leaves)
        ctx.leaves, ctx.outputs = leaves, outputs
        ctx.set_materialize_grads(False)  # an output the loss does not use needs no backward work
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        used = [(output, grad) for output, grad in zip(ctx.outputs, grads) if grad is not None and output.requires_grad]
        wanted = [i for i, leaf in enumerate(ctx.leaves) if leaf is not None and leaf.requires_grad]
        result = [None] * len(ctx.leaves)
        if used and wanted:
            with deterministic_algorithms():
                got = torch.autograd.grad(
                    [output for output, _ in used], [ctx.leaves[i] for i in wanted], [grad for _, grad in used], allow_unused=True
                )
            for i, grad in zip(wanted, got):
                result[i] = grad
        return (None, *result)


def with_deterministic_backward(compute: Callable[..., tuple], *inputs: torch.Tensor | None) -> tuple:
    """``compute(*inputs)`` (a tuple of tensors) whose backward runs under :func:`deterministic_algorithms`.

    Eager only: ``torch.compile`` cannot trace a backward that runs autograd itself, and there the global flag
    as it reads while compiling is what the compiled backward gets. ``inputs`` may hold None (an absent
    optional tensor)."""
    return _DeterministicBackward.apply(compute, *inputs)
