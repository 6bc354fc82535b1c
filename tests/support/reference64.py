"""The tests' one float64 reference: an independent, vectorized attention, plus the comparison the fuzz, bad-input and
LSE tests apply (``evaluate_call``) under the tolerance rule of ``support/tolerances.py``.

It shares no code with the package (``attention/reference.py``, ``attention/masking.py``): the visibility
rules are spelled out again here as explicit boolean masks, and gradients come from torch autograd. Run it
in float64 for the ground truth, or in the inputs' low-precision dtype to measure how far the same math
lands in that dtype (FlashAttention's tolerance rule).

Semantics (those of the package after its fixes):

* query ``i`` sees key ``j`` iff ``j < len_kv``, ``i < len_q`` and ``row - left <= j <= row + right``
  (a side at -1 is unbounded), where ``row = i + (len_kv - len_q)`` with ``bottom_right`` and a band,
  else ``row = i``; ``causal`` is ``right = 0``;
* dense lengths are clamped to ``[0, S]``; packed documents are ``cu[b]:cu[b + 1]`` and tokens past
  ``cu[-1]`` belong to no document;
* a sink adds ``exp(sink_h)`` to the denominator of every *valid* query row and carries no value; a
  row past its length (or in no document) is absent: zero output, ``lse = -inf``, zero gradient;
* a sequence (batch row or document) with no key at all is absent as a whole: zero output, ``lse = -inf``;
* a valid row of a sequence with keys that sees none of them (its window excludes them all) outputs zero
  (with a sink: all weight on the sink; without: nothing); its ``lse`` is ``sink_h``, or ``-inf`` without one.

Legend: B batch, N = H_kv, G query heads per KV head, Q/K query/key length, D head dim, T tokens.
"""

from __future__ import annotations

import math

import torch

from support.tolerances import noise_bound

__all__ = ["compare_tensors", "evaluate_call", "implied_qk_errors", "reference_attention", "reference_varlen_attention"]


# ----------------------------------------------------------------------------------------------
# Visibility masks
# ----------------------------------------------------------------------------------------------


def _bounds(causal: bool, window_size) -> tuple[int, int]:
    left, right = (int(window_size[0]), int(window_size[1])) if window_size is not None else (-1, -1)
    if causal:
        right = 0
    return left, right


def _band(i, j, len_q, len_kv, left: int, right: int, bottom_right: bool) -> torch.Tensor:
    """Visibility from in-sequence positions ``i`` (query) and ``j`` (key) and their sequences' lengths
    (all broadcastable integer tensors)."""
    visible = (i < len_q) & (j < len_kv)
    row = i + (len_kv - len_q) if (bottom_right and (left >= 0 or right >= 0)) else i
    if right >= 0:
        visible = visible & (j <= row + right)
    if left >= 0:
        visible = visible & (j >= row - left)
    return visible


def dense_visibility(
    B: int, S_q: int, S_kv: int, seqlens_q, seqlens_kv, *, causal=False, bottom_right=False, window_size=(-1, -1), device="cpu"
):
    """``(visible (B, Q, K) bool, row_valid (B, Q) bool)`` with lengths clamped to ``[0, S]``."""
    len_q = (
        torch.full((B,), S_q, dtype=torch.int64, device=device) if seqlens_q is None else seqlens_q.to(device, torch.int64).clamp(0, S_q)
    )
    len_kv = (
        torch.full((B,), S_kv, dtype=torch.int64, device=device)
        if seqlens_kv is None
        else seqlens_kv.to(device, torch.int64).clamp(0, S_kv)
    )
    left, right = _bounds(causal, window_size)
    i = torch.arange(S_q, device=device).view(1, S_q, 1)
    j = torch.arange(S_kv, device=device).view(1, 1, S_kv)
    visible = _band(i, j, len_q.view(B, 1, 1), len_kv.view(B, 1, 1), left, right, bottom_right)
    # A sequence with no key at all is absent as a whole (its rows get no sink and lse = -inf).
    row_valid = (torch.arange(S_q, device=device).view(1, S_q) < len_q.view(B, 1)) & (len_kv.view(B, 1) > 0)
    return visible, row_valid


def _token_documents(cu: torch.Tensor, T: int, device):
    """Per token: its document index (``B`` for none), its position in it, and that document's length."""
    cu = cu.to(device, torch.int64)
    B = cu.numel() - 1
    t = torch.arange(T, device=device)
    doc = torch.searchsorted(cu[1:].contiguous(), t, right=True)  # first b with cu[b + 1] > t
    doc = torch.where(t < cu[-1], doc, torch.full_like(doc, B)).clamp(max=B)
    safe = doc.clamp(max=max(B - 1, 0))
    lengths = cu[1:] - cu[:-1]
    return doc, t - cu[safe], lengths[safe] if B > 0 else torch.zeros_like(t)


def packed_visibility(T_q: int, T_kv: int, cu_q, cu_kv, *, causal=False, bottom_right=False, window_size=(-1, -1), device="cpu"):
    """``(visible (1, T_q, T_kv) bool, row_valid (1, T_q) bool)``: block diagonal over the documents."""
    B = cu_q.numel() - 1
    doc_q, pos_q, len_q_tok = _token_documents(cu_q, T_q, device)
    doc_kv, pos_kv, _ = _token_documents(cu_kv, T_kv, device)
    lengths_kv = (cu_kv[1:] - cu_kv[:-1]).to(device, torch.int64)
    len_kv_of_q = lengths_kv[doc_q.clamp(max=max(B - 1, 0))] if B > 0 else torch.zeros_like(doc_q)
    left, right = _bounds(causal, window_size)
    same_doc = (doc_q.view(T_q, 1) == doc_kv.view(1, T_kv)) & (doc_q.view(T_q, 1) < B)
    band = _band(pos_q.view(T_q, 1), pos_kv.view(1, T_kv), len_q_tok.view(T_q, 1), len_kv_of_q.view(T_q, 1), left, right, bottom_right)
    return (same_doc & band).unsqueeze(0), ((doc_q < B) & (len_kv_of_q > 0)).unsqueeze(0)


# ----------------------------------------------------------------------------------------------
# The math
# ----------------------------------------------------------------------------------------------


def _softmax_attention(q_NHGQD, k_NHKD, v_NHKD, visible_NQK, row_valid_NQ, scale, sinks, compute_dtype):
    """Masked softmax attention; returns ``(out (N, H_kv, G, Q, D_v), lse (N, H_kv, G, Q) float)``."""
    N, H_kv, G, Q, _ = q_NHGQD.shape
    K = k_NHKD.shape[2]
    scores = torch.einsum("nhgqd,nhkd->nhgqk", q_NHGQD, k_NHKD) * scale
    scores = scores.masked_fill(~visible_NQK.view(N, 1, 1, Q, K), float("-inf"))
    if sinks is not None:
        # One more logit per valid row; absent rows do not see the sink either.
        sink = sinks.to(compute_dtype).view(1, H_kv, G, 1, 1).expand(N, H_kv, G, Q, 1)
        sink = sink.masked_fill(~row_valid_NQ.view(N, 1, 1, Q, 1), float("-inf"))
        scores = torch.cat([scores, sink], dim=-1)
    if scores.shape[-1] == 0:
        row_max = scores.new_zeros(N, H_kv, G, Q, 1)
    else:
        row_max = scores.detach().amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)
    denom = exp.sum(dim=-1, keepdim=True)
    probs = exp / torch.where(denom == 0, torch.ones_like(denom), denom)  # NaN stays NaN (NaN sinks)
    out = torch.einsum("nhgqk,nhkd->nhgqd", probs[..., :K], v_NHKD)
    # Differentiable (d lse / d score = the probability; row_max is a constant of both terms): losses over the LSE, and
    # implied_qk_errors, use it. A row with nothing in its denominator has lse = -inf and no gradient: the log reads 1
    # there, since log'(0) = inf would turn the zero that the outer where hands back into NaN (the double-where pattern).
    denom = denom.to(torch.float64 if compute_dtype == torch.float64 else torch.float32)
    empty = denom == 0
    lse = torch.where(empty, float("-inf"), torch.log(torch.where(empty, torch.ones_like(denom), denom)) + row_max.detach()).squeeze(-1)
    lse = lse.masked_fill(~row_valid_NQ.view(N, 1, 1, Q), float("-inf"))
    return out, lse


def _default_scale(scale, D):
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def reference_attention(
    q,
    k,
    v,
    *,
    scale=None,
    causal=False,
    bottom_right=False,
    window_size=(-1, -1),
    sinks=None,
    seqlens_q=None,
    seqlens_kv=None,
    return_lse=False,
    compute_dtype=torch.float64,
    return_masks=False,
    **_ignored,
):
    """Mirror of ``cudnn_attention.attention`` over (B, H, S, D) inputs (any strides), computed in ``compute_dtype``.

    Returns ``out`` (B, H_q, S_q, D_v) in ``compute_dtype`` (and ``lse`` (B, H_q, S_q) when asked); with
    ``return_masks`` also ``{"zero_q": (B, S_q) rows that see no key, "zero_kv": (B, S_kv) keys no row sees}``.
    """
    B, H, Q, D = q.shape
    H_kv, K, D_v = k.shape[1], k.shape[2], v.shape[3]
    G = H // H_kv
    visible, row_valid = dense_visibility(
        B, Q, K, seqlens_q, seqlens_kv, causal=causal, bottom_right=bottom_right, window_size=window_size, device=q.device
    )
    out, lse = _softmax_attention(
        q.to(compute_dtype).reshape(B, H_kv, G, Q, D),
        k.to(compute_dtype),
        v.to(compute_dtype),
        visible,
        row_valid,
        _default_scale(scale, D),
        sinks,
        compute_dtype,
    )
    result = [out.reshape(B, H, Q, D_v)]
    if return_lse:
        result.append(lse.reshape(B, H, Q))
    if return_masks:
        result.append({"zero_q": ~visible.any(-1), "zero_kv": ~visible.any(-2)})
    return result[0] if len(result) == 1 else tuple(result)


def reference_varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv,
    max_seqlen_q=None,
    max_seqlen_kv=None,
    *,
    scale=None,
    causal=False,
    bottom_right=False,
    window_size=(-1, -1),
    sinks=None,
    return_lse=False,
    compute_dtype=torch.float64,
    return_masks=False,
    **_ignored,
):
    """Mirror of ``cudnn_attention.varlen_attention`` over packed (T, H, D) inputs; ``max_seqlen_*`` are not needed.

    Returns ``out`` (T_q, H_q, D_v) (and ``lse`` (T_q, H_q)); masks as in :func:`reference_attention`, (T_q,) and (T_kv,).
    """
    T_q, H, D = q.shape
    T_kv, H_kv, D_v = k.shape[0], k.shape[1], v.shape[2]
    G = H // H_kv
    visible, row_valid = packed_visibility(
        T_q, T_kv, cu_seqlens_q, cu_seqlens_kv, causal=causal, bottom_right=bottom_right, window_size=window_size, device=q.device
    )
    out, lse = _softmax_attention(
        q.to(compute_dtype).permute(1, 0, 2).reshape(1, H_kv, G, T_q, D),
        k.to(compute_dtype).permute(1, 0, 2).unsqueeze(0),
        v.to(compute_dtype).permute(1, 0, 2).unsqueeze(0),
        visible,
        row_valid,
        _default_scale(scale, D),
        sinks,
        compute_dtype,
    )
    result = [out.reshape(H, T_q, D_v).permute(1, 0, 2)]
    if return_lse:
        result.append(lse.reshape(H, T_q).permute(1, 0))
    if return_masks:
        result.append({"zero_q": ~visible.any(-1)[0], "zero_kv": ~visible.any(-2)[0]})
    return result[0] if len(result) == 1 else tuple(result)


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------


def compare_tensors(name: str, got, ref, lowp, *, floor_rel: float, magnitude: float = 0.0, flash=None, implied: float = 0.0) -> dict:
    """FlashAttention's rule (``support.tolerances.noise_bound``):
    ``max|got - ref| <= 2 * max|lowp - ref| + implied + floor_rel * max(max|ref|, magnitude)``.

    ``magnitude`` keeps the floor meaningful where the reference is exactly zero although the kernel
    does real arithmetic (dQ and dK when each row sees one key: ``P (dP - D)`` cancels to zero only
    in exact math); gradients pass the magnitude of the output gradient that drives them. ``flash``,
    when given, is a second low-precision estimate (the flash-style dSink, see
    :func:`flash_style_dsinks`), and the larger of the two errors sets the noise level. ``implied`` is
    the error the result must carry because of an input already judged on its own (dQ and dK through the
    output O, see :func:`implied_qk_errors`); it adds to the bound, not doubled.

    NaN and infinite entries must sit where the reference has them (same sign); the rule applies to
    the finite rest. Returns ``{"name", "ok", "err", "bound", "why"}``.
    """
    result = {"name": name, "ok": True, "err": 0.0, "bound": 0.0, "why": ""}
    if got is None:
        got = torch.zeros_like(ref)
    if tuple(got.shape) != tuple(ref.shape):
        return {**result, "ok": False, "why": f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}"}
    got, ref, lowp = got.detach().double(), ref.detach().double(), lowp.detach().double()
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        g, r = test(got), test(ref)
        if not torch.equal(g, r):
            return {**result, "ok": False, "why": f"{what} pattern differs: {int(g.sum())} in result, {int(r.sum())} in reference"}
    finite = torch.isfinite(ref)
    if not finite.any():
        return result
    got, ref, lowp = got[finite], ref[finite], lowp[finite]
    lowp_finite = torch.isfinite(lowp)
    base = (lowp[lowp_finite] - ref[lowp_finite]).abs().max().item() if lowp_finite.any() else 0.0
    if not lowp_finite.all():  # the low-precision math overflowed: no meaningful noise estimate there
        base = max(base, ref.abs().max().item())
    if flash is not None:
        flash = flash.detach().double()[finite]
        base = max(base, (flash - ref).abs().max().item())
    err = (got - ref).abs().max().item()
    bound = noise_bound(base, max(ref.abs().max().item(), magnitude), floor_rel=floor_rel, implied=implied)
    ok = err <= bound
    return {
        "name": name,
        "ok": ok,
        "err": err,
        "bound": bound,
        "why": "" if ok else f"error {err:.3g} > bound {bound:.3g} (low-precision error {base:.3g})",
    }


def _exact_zero(name: str, tensor, rows_mask, row_dim: int) -> dict | None:
    """Rows flagged in ``rows_mask`` (the leading dims of ``tensor`` up to ``row_dim``) must be exactly zero."""
    if tensor is None or not bool(rows_mask.any()):
        return None
    moved = tensor.detach().movedim(row_dim, rows_mask.dim() - 1) if tensor.dim() > 1 else tensor.detach()
    # Bring the row dim next to the batch dims that rows_mask indexes: dense (B, H, S, D) -> (B, S, H, D).
    picked = moved[rows_mask]
    if picked.numel() and not bool((picked == 0).all()):
        bad = picked[picked != 0]
        return {
            "name": f"{name}_zero_rows",
            "ok": False,
            "err": float(bad.double().abs().nan_to_num(nan=float("inf")).max()),
            "bound": 0.0,
            "why": f"{int((picked != 0).sum())} entries of rows that must be exactly zero are not (e.g. {bad.flatten()[0].item():.3g})",
        }
    return None


def flash_style_dsinks(out_ref, lse_ref, grad_out, sinks, low_dtype, grad_lse=None) -> torch.Tensor:
    """dSink as a fused kernel computes it: ``-sum_rows exp(sink - lse) * rowsum(dO * O)`` with the exact
    LSE but O rounded to ``low_dtype`` (what any kernel hands its backward), in float64, then rounded to
    the sinks' dtype. Rounding O alone costs dSink more than the autograd of a low-precision reference
    in small problems, and no kernel can read a better O than its own, so this is the fair noise level
    for dSink. With ``grad_lse`` (a loss that uses the LSE) the exact ``sum_rows exp(sink - lse) * dLSE``
    joins it: the LSE depends on the sink, and that term involves no rounded O."""
    o_low = out_ref.detach().to(low_dtype).double()
    lse = lse_ref.detach().double()
    sinks_view = sinks.detach().double().view(1, -1, 1) if lse.dim() == 3 else sinks.detach().double().view(1, -1)
    weight = torch.where(torch.isfinite(lse), torch.exp(sinks_view - lse), torch.zeros_like(lse))
    row_dot = (grad_out.double() * o_low).sum(-1)
    if grad_lse is not None:
        row_dot = row_dot - grad_lse.double()
    reduce_dims = (0, 2) if lse.dim() == 3 else (0,)
    return (-(weight * row_dot).sum(reduce_dims)).to(sinks.dtype)


def dsinks_error_sources(out_got, lse_got, out_ref, lse_ref, grad_out, sinks) -> dict:
    """Where a dSink error comes from, for a failure's message and the GPU grid's table (never a bound: dSink is held to
    FlashAttention's rule as it is).

    dSink is ``-sum_rows exp(sink - lse) * rowsum(dO * O)``: its error is the O term's plus the LSE term's, and a
    systematic error survives the sum over rows where rounding cancels. A fused kernel reads its own O (it cannot read a
    better one), so the output's error, which the ``out`` check judges on its own, moves dSink by ``by_out`` however exact
    the reduction. Returns ``{"by_out", "by_lse", "out_scale", "lse_shift"}``: the dSink error of the exact identity fed
    the kernel's O with the exact LSE, then the exact O with the kernel's LSE; the mean over rows of
    ``<O, O_ref> / <O_ref, O_ref> - 1`` (a scale bias of O); and the mean ``lse - lse_ref`` over finite rows (a shift of
    the LSE). The O terms are 0.0 when O's shape is not the reference's, the LSE ones None when the call returned none."""
    sinks64 = sinks.detach().double()

    def error(out, lse) -> float:
        return (flash_style_dsinks(out, lse, grad_out, sinks64, torch.float64) - exact).abs().max().item()

    exact = flash_style_dsinks(out_ref, lse_ref, grad_out, sinks64, torch.float64)
    sources = {"by_out": 0.0, "out_scale": 0.0, "by_lse": None, "lse_shift": None}
    if out_got is not None and tuple(out_got.shape) == tuple(out_ref.shape):
        sources["by_out"] = error(out_got.detach(), lse_ref)
        got, ref = out_got.detach().double(), out_ref.detach().double()
        norm = (ref * ref).sum(-1)
        rows = norm > 0
        sources["out_scale"] = ((got * ref).sum(-1)[rows] / norm[rows] - 1).mean().item() if rows.any() else 0.0
    if lse_got is not None and tuple(lse_got.shape) == tuple(lse_ref.shape):
        sources["by_lse"] = error(out_ref, lse_got.detach().double())
        finite = torch.isfinite(lse_ref.detach()) & torch.isfinite(lse_got.detach())
        sources["lse_shift"] = (lse_got.detach().double() - lse_ref.detach())[finite].mean().item() if finite.any() else 0.0
    return sources


def implied_qk_errors(out_got, out_ref, lse_ref, grad_out, leaves64: dict, names: list) -> dict:
    """The dQ and dK errors an exact backward would still show, given the kernel's own output.

    A fused backward computes ``D_i = rowsum(dO * O)`` from the output it wrote (rounded to 16 bits), not the exact
    one, and ``dS = P (dP - D)``. Its D is off by ``delta_i = rowsum(dO * (O_got - O_ref))``, which moves dS by
    ``-P delta``: exactly the gradient of ``-sum_i delta_i lse_i`` (``d lse / d s = P``). Where a row sees one key and a
    sink, ``dP - D`` cancels and this dominates (a row of dense D 256, window (0, 1), S_kv 1: dQ 8.8e-3 against a
    bound of 8.3e-3 without it). The output is judged on its own, so this adds to the bound, not doubled; dV is
    ``P^T dO`` and takes no D. Returns ``{"dq": err, "dk": err}`` for the names among them that are compared."""
    wanted = [n for n in ("dq", "dk") if n in names]
    if out_got is None or not wanted or tuple(out_got.shape) != tuple(out_ref.shape) or not lse_ref.requires_grad:
        return {}
    delta = (grad_out.double() * (out_got.detach().double() - out_ref.detach())).sum(-1)
    finite = torch.isfinite(lse_ref.detach()) & torch.isfinite(delta)
    weighted = torch.where(finite, lse_ref, torch.zeros_like(lse_ref)) * torch.where(finite, delta, torch.zeros_like(delta))
    grads = torch.autograd.grad(weighted.sum(), [leaves64[n[1:]] for n in wanted], allow_unused=True)
    return {n: (g.abs().max().item() if g is not None and g.numel() else 0.0) for n, g in zip(wanted, grads)}


def evaluate_call(
    api: str, args: tuple, kwargs: dict, *, grads: bool = True, floor_rel: float | None = None, grad_seed: int = 0, loss: str = "out"
) -> dict:
    """Call ``cudnn_attention.attention``/``varlen_attention`` with ``args``/``kwargs``, run its backward, and
    compare output, lse (when ``return_lse``) and every gradient against the float64 reference.

    ``loss`` says what the backward starts from: ``"out"`` (a random output gradient), ``"out+lse"`` (random
    gradients of both the output and the LSE, ``return_lse`` required) or ``"lse"`` (the LSE's alone). The LSE's
    gradient is random on every row, ``-inf`` ones too: those rows must pass none of it on.

    ``args`` are ``(q, k, v)`` (dense) or ``(q, k, v, cu_q, cu_kv, max_q, max_kv)`` (packed); tensors among
    q/k/v/sinks that require grad (leaves or views of leaves) get gradients. The low-precision estimate is
    the same reference in q's dtype (float16/bfloat16), or float32 for float32 inputs. ``floor_rel``
    defaults to 1e-3 for 16-bit inputs and 2e-5 for float32/float64.
    Returns ``{"ok", "checks": [compare_tensors results], "error_summary": {name: err}}``.
    """
    import cudnn_attention

    q, k, v = args[:3]
    rest = args[3:]
    sinks = kwargs.get("sinks")
    return_lse = bool(kwargs.get("return_lse", False))
    fn = cudnn_attention.attention if api == "dense" else cudnn_attention.varlen_attention
    reference = reference_attention if api == "dense" else reference_varlen_attention
    low = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float32
    if floor_rel is None:
        floor_rel = 1e-3 if low != torch.float32 else 2e-5

    if loss not in ("out", "out+lse", "lse") or (loss != "out" and not return_lse):
        raise ValueError(f"loss={loss!r}: expected 'out', or 'out+lse'/'lse' with return_lse=True")
    names = [n for n, t in (("dq", q), ("dk", k), ("dv", v), ("dsinks", sinks)) if t is not None and t.requires_grad]
    wants_grads = grads and bool(names)
    result = fn(*args, **kwargs)
    out, lse = result if return_lse else (result, None)
    got = {"out": out, "lse": lse}
    grad_out = grad_lse = None
    if wants_grads:
        torch.manual_seed(grad_seed)
        grad_out = torch.randn(out.shape, dtype=out.dtype, device=out.device)
        if loss != "out":
            grad_lse = torch.randn(lse.shape, dtype=lse.dtype, device=lse.device)
        if loss == "lse":
            grad_out = torch.zeros_like(grad_out)  # the formulas below read it; autograd does not get it
        targets = [t for t in (q, k, v, sinks) if t is not None and t.requires_grad]
        outputs, grad_outputs = _loss_terms(loss, out, lse, grad_out, grad_lse)
        got.update(zip(names, torch.autograd.grad(outputs, targets, grad_outputs, allow_unused=True)))

    def run_reference(dtype):
        leaves = {}
        for n, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
            if t is not None:
                # Sinks keep their own dtype in the low-precision run (the math rounds them to `dtype`).
                t = t.detach().to(dtype if (n != "sinks" or dtype == torch.float64) else t.dtype).clone()
                t.requires_grad_(wants_grads and f"d{n}" in names)
            leaves[n] = t
        ref_kwargs = {**kwargs, "sinks": leaves["sinks"], "return_lse": True, "compute_dtype": dtype, "return_masks": True}
        ref_out, ref_lse, masks = reference(leaves["q"], leaves["k"], leaves["v"], *rest, **ref_kwargs)
        values = {"out": ref_out, "lse": ref_lse}
        if wants_grads:
            targets = [leaves[n[1:]] for n in names]
            lse_weights = None if grad_lse is None else grad_lse.to(ref_lse.dtype)
            outputs, grad_outputs = _loss_terms(loss, ref_out, ref_lse, grad_out.to(dtype), lse_weights)
            values.update(zip(names, torch.autograd.grad(outputs, targets, grad_outputs, allow_unused=True, retain_graph=True)))
        return values, masks, leaves

    ref, masks, leaves64 = run_reference(torch.float64)
    lowp, _, _ = run_reference(low)
    implied_qk = implied_qk_errors(got["out"], ref["out"], ref["lse"], grad_out, leaves64, names) if wants_grads else {}
    compared = ["out", "lse"] if return_lse else ["out"]
    compared += names if wants_grads else []
    checks = []
    for name in compared:
        # A reference gradient of None is zero (a loss over the LSE alone does not reach V), on the result's device.
        device = got[name].device if got[name] is not None else "cpu"
        want = (
            ref[name]
            if ref[name] is not None
            else torch.zeros(got[name].shape if got[name] is not None else (), dtype=torch.float64, device=device)
        )
        base = lowp[name] if lowp[name] is not None else torch.zeros_like(want)
        magnitude = grad_out.abs().max().item() if name.startswith("d") and grad_out.numel() else 0.0
        if name.startswith("d") and grad_lse is not None and grad_lse.numel():
            magnitude = max(magnitude, grad_lse.abs().max().item())
        flash = flash_style_dsinks(ref["out"], ref["lse"], grad_out, sinks, low, grad_lse) if name == "dsinks" else None
        # dSink gets FlashAttention's rule as it is: no allowance for the error the kernel's own O carries (FlashAttention 4,
        # which also reduces dSink from its O, meets it). dQ and dK keep theirs (see implied_qk_errors).
        implied = implied_qk.get(name, 0.0)
        check = compare_tensors(name, got[name], want, base, floor_rel=floor_rel, magnitude=magnitude, flash=flash, implied=implied)
        if name == "dsinks" and not check["ok"] and grad_lse is None:
            sources = dsinks_error_sources(got["out"], got["lse"], ref["out"], ref["lse"], grad_out, sinks)
            by_lse = "not returned" if sources["by_lse"] is None else f"{sources['by_lse']:.3g} (mean shift {sources['lse_shift']:.2e})"
            check["why"] += (
                f"; from the kernel's O {sources['by_out']:.3g} (O's mean scale bias {sources['out_scale']:.2e}), from its LSE {by_lse}"
            )
        checks.append(check)
    # Structurally zero rows must be exactly zero: rows that see no key (out, dq), keys no row sees (dk, dv).
    row_dim = 0 if api != "dense" else 2
    for name, mask_name in (("out", "zero_q"), ("dq", "zero_q"), ("dk", "zero_kv"), ("dv", "zero_kv")):
        tensor = got.get(name)
        if tensor is not None and ref.get(name) is not None and tuple(tensor.shape) == tuple(ref[name].shape):
            check = _exact_zero(name, tensor, masks[mask_name].to(tensor.device), row_dim)
            if check is not None:
                checks.append(check)
    for n in ("dq", "dk", "dv", "dsinks"):
        # A reference gradient of None is zero (a loss over the LSE alone does not reach V).
        if got.get(n) is not None and (ref[n] is None or bool(torch.isfinite(ref[n]).all())) and not bool(torch.isfinite(got[n]).all()):
            checks.append({"name": f"{n}_finite", "ok": False, "err": float("inf"), "bound": 0.0, "why": "non-finite gradient"})
    return {
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
        "error_summary": {c["name"]: c["err"] for c in checks},
        "shapes": {n: list(t.shape) for n, t in got.items() if t is not None},
    }


def _loss_terms(loss: str, out, lse, grad_out, grad_lse) -> tuple[list, list]:
    """``(outputs, grad_outputs)`` for ``torch.autograd.grad``: what the loss ``loss`` differentiates."""
    if loss == "out":
        return [out], [grad_out]
    if loss == "lse":
        return [lse], [grad_lse]
    return [out, lse], [grad_out, grad_lse]
