"""The gradients a random projection of an output sends to its leaves, for tests that compare two ways of one call."""

import torch

__all__ = ["projection_gradients"]


def projection_gradients(out: torch.Tensor, leaves: tuple, *, seed: int = 1) -> list[torch.Tensor]:
    """Backward of ``sum(out * r)`` (``r`` standard normal, drawn after seeding with ``seed``): each leaf's gradient,
    copied, and the leaves' ``.grad`` cleared for the next call."""
    torch.manual_seed(seed)
    (out.float() * torch.randn(out.shape)).sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return grads
