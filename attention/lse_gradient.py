"""The LSE's gradient on cuDNN: cuDNN's backward graph takes no dLSE, so its share comes from one more launch of the same
graph on stand-in operands whose dQ and dK are exactly the LSE's share (docs/decisions/0007), and the sinks' share of
it in closed form. The operands are built here; :func:`cudnn_attention.launch.run_backward` launches them.
"""

from __future__ import annotations

import torch

__all__ = ["lse_gradient_operands", "lse_sink_gradient", "masked_lse_gradient", "zeros_strided"]


def masked_lse_gradient(grad_lse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """dLSE in float32, zero on rows with lse = -inf (padding, capacity tails, documents or rows without keys):
    they have no softmax to differentiate, so whatever gradient reached them (NaN included) stops here, before it
    becomes an operand. ``grad_lse`` may have any strides (the gradient of ``lse.sum()`` is an expanded scalar)."""
    return grad_lse.float().masked_fill(lse == float("-inf"), 0.0)


# The stand-in O' is 2**e per row with e in this range: a normal float16 (and bfloat16) value, exact in either.
_UNIT_EXPONENTS = (-14, 15)


def lse_gradient_operands(dlse: torch.Tensor, out: torch.Tensor, v: torch.Tensor):
    """``(V', O', dO')``: operands for a launch of the backward graph whose dQ and dK are the LSE's share.

    With P the (sink-inclusive) probabilities the graph recomputes from the LSE, a loss's gradient of the
    scores is ``dS = P * (dP - D + dLSE)``, ``dP = dO V^T`` and ``D = rowsum(dO * O)``, which cuDNN computes
    itself from the O and dO it is handed (O serves nothing else). ``V' = 0`` makes ``dP' = 0`` and
    ``rowsum(dO' * O') = -dLSE`` makes ``D' = -dLSE``, so that launch's ``dS' = P * dLSE`` and its dQ' and dK'
    (``scale * dS' K``, ``scale * dS'^T Q``) are the LSE's share; its dV' (``P^T dO'``) is no gradient.

    dLSE (float32) is carried in the input dtype without rounding it to 8 or 11 bits: O' holds ``2**e`` and dO'
    ``-dLSE / 2**e`` split as ``hi + lo`` in its first two head-dim columns (``hi`` the rounded value, ``lo``
    the rounded rest), so cuDNN's float32 ``D' = 2**e * (hi + lo)`` is -dLSE to about 17 significant bits in
    bfloat16 and 23 in float16. The per-row power of two ``2**e`` (of dLSE's own magnitude, within float16's
    normal range) keeps ``hi`` and ``lo`` inside float16's narrow range, as a mean over many rows needs (dLSE
    of 1e-6 and less). float16 still bounds it: 23 bits for |dLSE| from 1e-5 to 2e9, then fewer as ``lo``
    and below 4e-9 ``hi`` leave its normal range (as a float16 output gradient would; float16 training
    scales its loss), inf beyond 2e9. A value dimension of 1 has no second column: dLSE is rounded once there.
    ``test_lse_grad_emulated.py`` measures all of this.

    Each stand-in has the strides of the operand it replaces (the graph holds the descriptors, a launch passes
    addresses): V' v's, O' and dO' out's (dO is read with O's descriptor). No device value is read on the host.
    """
    dtype = out.dtype
    v_zero = zeros_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    o_unit = zeros_strided(out.shape, out.stride(), dtype=dtype, device=out.device)
    do_lse = zeros_strided(out.shape, out.stride(), dtype=dtype, device=out.device)
    target = -dlse
    _, exponent = torch.frexp(target)  # target = mantissa * 2**exponent, 0.5 <= |mantissa| < 1 (exponent 0 for 0)
    unit = torch.exp2(exponent.clamp(*_UNIT_EXPONENTS).to(torch.float32))
    scaled = target / unit  # exact: a power of two
    hi = scaled.to(dtype)
    o_unit[..., 0] = unit.to(dtype)
    do_lse[..., 0] = hi
    if out.shape[-1] >= 2:
        o_unit[..., 1] = unit.to(dtype)
        do_lse[..., 1] = (scaled - hi.float()).to(dtype)
    return v_zero, o_unit, do_lse


def zeros_strided(shape, stride, *, dtype, device) -> torch.Tensor:
    """Zeros with exactly these strides, for any strides a caller's operand may have: gaps (q, k and v sliced out
    of one projection) and overlaps (an expanded tensor, stride 0) alike, which ``empty_strided(...).zero_()``
    does not allow for the latter."""
    span = 1 + sum((n - 1) * step for n, step in zip(shape, stride)) if all(n > 0 for n in shape) else 0
    return torch.zeros(span, dtype=dtype, device=device).as_strided(shape, stride)


def lse_sink_gradient(dlse: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The LSE's share of dSink (H,) float32: the sink is one more logit in the denominator, so ``d lse_row /
    d sink_h = exp(sink_h - lse_row)``. Rows with lse = -inf contribute nothing (their dLSE is zero already, and
    ``exp`` would be inf there). Dense LSE (B, H, S), packed (T, H), as in :func:`sink_gradient`."""
    sinks_view = sinks.view(1, -1, 1) if lse.dim() == 3 else sinks.view(1, -1)
    terms = torch.where(lse == float("-inf"), 0.0, dlse * torch.exp(sinks_view - lse))
    return terms.sum((0, 2) if lse.dim() == 3 else (0,))
