"""The tests' one tolerance rule (FlashAttention's): a low-precision result's error against a higher-precision reference
may be at most twice the error of PyTorch doing the same math in low precision, plus a small slack relative to the
reference's magnitude. ``lowp_noise_bound`` and ``assert_within_lowp_noise`` apply it to whole tensors (the GPU tests,
against an fp32 reference); ``support.reference64.compare_tensors`` (against float64) and ``support.model_gradients``
(relative errors of whole-model gradients) apply ``noise_bound`` to their own error measures."""

import torch

from cudnn_attention.tolerance import noise_bound  # the rule itself: the package's doctor applies the same one

__all__ = ["assert_within_lowp_noise", "lowp_noise_bound", "noise_bound"]


def lowp_noise_bound(ref: torch.Tensor, lowp: torch.Tensor) -> float:
    """The rule's bound: twice ``lowp``'s error against the fp32 ``ref``, plus 1e-3 of ``ref``'s largest magnitude."""
    return _bound_and_terms(ref, lowp)[0]


def _bound_and_terms(ref: torch.Tensor, lowp: torch.Tensor) -> tuple[float, float, float]:
    base = (lowp.float() - ref.float()).abs().max().item()
    magnitude = ref.float().abs().max().item()
    return noise_bound(base, magnitude), base, magnitude


def assert_within_lowp_noise(name: str, got: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor) -> None:
    """``got`` within the rule, where ``ref`` is the fp32 reference and ``lowp`` the same math in low precision."""
    err = (got.float() - ref.float()).abs().max().item()
    bound, base, magnitude = _bound_and_terms(ref, lowp)
    assert err <= bound, f"{name}: cuDNN error {err:.3g} > bound {bound:.3g} (torch low-precision error {base:.3g}, |ref| {magnitude:.3g})"
