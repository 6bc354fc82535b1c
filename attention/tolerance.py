"""The one tolerance rule (FlashAttention's): a low-precision result's error against a higher-precision reference may be
at most twice the error of PyTorch doing the same math in low precision, plus a small slack relative to the reference's
magnitude. The doctor applies it to its self-checks; the tests (``tests/support/tolerances.py``) to theirs.
"""

from __future__ import annotations

import torch

__all__ = ["noise_bound", "within_lowp_noise"]


def noise_bound(base: float, magnitude: float, *, floor_rel: float = 1e-3, implied: float = 0.0) -> float:
    """The rule: ``2 * base + implied + floor_rel * magnitude``.

    ``base`` is the error of the same math in low precision against the reference, ``magnitude`` the reference's
    size the slack is relative to, and ``implied`` an error the result must carry because of an input already judged
    on its own; it adds to the bound, not doubled.
    """
    return 2 * base + implied + floor_rel * magnitude


def within_lowp_noise(got: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor) -> tuple[float, float]:
    """``(error, bound)``: ``got``'s largest error against the high-precision ``ref``, and the rule's bound for ``lowp``
    (torch's own low-precision math) with a slack of 1e-3 of ``ref``'s largest magnitude. NaN anywhere in ``got`` makes
    the error NaN, which no bound admits."""
    ref = ref.double()
    error = (got.double() - ref).abs().max().item() if got.numel() else 0.0
    base = (lowp.double() - ref).abs().max().item() if lowp.numel() else 0.0
    magnitude = ref.abs().max().item() if ref.numel() else 0.0
    return error, noise_bound(base, magnitude)
