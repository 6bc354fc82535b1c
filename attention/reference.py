"""The exact PyTorch path: fp32 math (float64 for float64 inputs) with the same semantics as the cuDNN
path, differentiable (the LSE too).

It serves whatever cuDNN cannot (CPU tensors, float32, float64, a configuration the installed cuDNN
rejects) and is the reference the GPU tests compare against. Fully masked rows give a zero output and
``lse = -inf`` (``lse = sink`` is not used: a padded row is absent, not attending to the sink).

float64 inputs are computed in float64 throughout, sinks included whatever their dtype, and give a
float64 LSE: rounding them through float32 would return float64 tensors carrying float32 error, and
``torch.autograd.gradcheck`` (whose finite differences step by 1e-6) would fail, as it does not for
torch's own math SDPA. Every other dtype is computed in float32 with a float32 LSE.

Legend: B batch, H query heads, G = H // H_kv query heads per KV head, Q/K query/key length,
D head dim, T packed tokens.
"""

from __future__ import annotations

import torch

from .dtypes import exact_math_dtype
from .layouts import like_layout_strides
from .masking import MaskSpec, visible_keys

__all__ = ["dense_reference", "exact_attention", "varlen_reference"]

# Documents processed together by the packed path: bounds the (chunk, H, S_q, S_kv) scores.
_VARLEN_SCORE_BUDGET_BYTES = 256 * 2**20


def dense_reference(
    q_BHQD: torch.Tensor,
    k_BHKD: torch.Tensor,
    v_BHKD: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    sinks_H: torch.Tensor | None = None,
    seqlens_q_B: torch.Tensor | None = None,
    seqlens_kv_B: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over (B, H, S, D) tensors. Returns ``(out in q's dtype, lse (B, H, Q))``.

    ``compute_dtype``: None (the fallback) computes in :func:`~cudnn_attention.dtypes.exact_math_dtype` of q's dtype; tests pass the
    input dtype to measure how far PyTorch's own low-precision math lands from fp32. ``lse`` is float64
    when the math is, else float32, and differentiable (through q, k and the sinks); its ``-inf`` rows
    pass no gradient on, whatever gradient reaches them.
    """
    B, H, Q, D = q_BHQD.shape
    H_kv, K, D_v = k_BHKD.shape[1], k_BHKD.shape[2], v_BHKD.shape[3]
    G = H // H_kv
    device = q_BHQD.device
    if compute_dtype is None:
        compute_dtype = exact_math_dtype(q_BHQD.dtype)
    lse_dtype = exact_math_dtype(compute_dtype)
    len_q_B = seqlens_q_B if seqlens_q_B is not None else torch.full((B,), Q, device=device)
    len_kv_B = seqlens_kv_B if seqlens_kv_B is not None else torch.full((B,), K, device=device)
    visible_B11QK = visible_keys(mask, len_q_B, len_kv_B, Q, K).view(B, 1, 1, Q, K)

    # Group query heads by their KV head instead of repeating K/V (same math, no copy).
    q_BNGQD = q_BHQD.to(compute_dtype).reshape(B, H_kv, G, Q, D)
    scores_BNGQK = torch.einsum("bngqd,bnkd->bngqk", q_BNGQD, k_BHKD.to(compute_dtype)) * scale
    scores_BNGQK = scores_BNGQK.masked_fill(~visible_B11QK, float("-inf"))
    row_valid_B11Q = (torch.arange(Q, device=device).view(1, Q) < len_q_B.view(B, 1)).view(B, 1, 1, Q)
    if sinks_H is not None:
        # gpt-oss: the sink is one more logit in the denominator that carries no value. Rows past a
        # sequence's length are absent, so they see no sink either (a NaN sink must not reach them).
        sink_BNGQ1 = sinks_H.to(compute_dtype).view(1, H_kv, G, 1, 1).expand(B, H_kv, G, Q, 1)
        sink_BNGQ1 = sink_BNGQ1.masked_fill(~row_valid_B11Q[..., None], float("-inf"))
        scores_BNGQK = torch.cat([scores_BNGQK, sink_BNGQ1], dim=-1)
    # A stable softmax that turns fully masked rows into zeros rather than NaN (forward and backward).
    row_max = scores_BNGQK.detach().amax(dim=-1, keepdim=True) if scores_BNGQK.shape[-1] else scores_BNGQK.new_zeros(B, H_kv, G, Q, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp_BNGQK = torch.exp(scores_BNGQK - row_max)
    denom_BNGQ1 = exp_BNGQK.sum(dim=-1, keepdim=True)
    # Only an exact zero (no visible key, no sink) is replaced: a NaN from NaN input must stay NaN, as in torch.
    probs_BNGQK = exp_BNGQK / torch.where(denom_BNGQ1 == 0, torch.ones_like(denom_BNGQ1), denom_BNGQ1)
    if sinks_H is not None:
        probs_BNGQK = probs_BNGQK[..., :K]
    out_BNGQD = torch.einsum("bngqk,bnkd->bngqd", probs_BNGQK, v_BHKD.to(compute_dtype))

    # d lse / d score is the probability (row_max is a constant of both terms, detached above). A row with an empty
    # denominator (no visible key, no sink) has lse = -inf: the log reads 1 there, because log'(0) = inf would turn
    # the zero the outer where passes back into NaN (the double-where pattern), which only the scores' masked_fill
    # would stop further down; a NaN denominator (NaN input) stays NaN.
    denom_BNGQ1 = denom_BNGQ1.to(lse_dtype)
    empty_BNGQ1 = denom_BNGQ1 == 0
    log_denom_BNGQ1 = torch.log(torch.where(empty_BNGQ1, torch.ones_like(denom_BNGQ1), denom_BNGQ1))
    lse_BNGQ = torch.where(empty_BNGQ1, float("-inf"), log_denom_BNGQ1 + row_max.to(lse_dtype)).squeeze(-1)
    lse_BNGQ = lse_BNGQ.masked_fill(~row_valid_B11Q, float("-inf"))  # masked_fill passes no gradient to the filled rows
    out_BHQD = out_BNGQD.reshape(B, H, Q, D_v).to(q_BHQD.dtype)
    return out_BHQD, lse_BNGQ.reshape(B, H, Q)


def varlen_reference(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    scale: float,
    mask: MaskSpec,
    sinks_H: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed (T, H, D) documents. Returns ``(out (T, H, D_v), lse (T, H))``, dtypes and
    ``compute_dtype`` as in :func:`dense_reference`.

    Documents are gathered into padded chunks of at most a few hundred MiB of scores, so memory
    grows with the longest document, never with T x T, and no length is read back to the host.
    Tokens past ``cu_seqlens[-1]`` (a capacity tail) get a zero output and ``lse = -inf``.
    """
    T_q, H, _ = q_THD.shape
    D_v = v_THD.shape[2]
    B = cu_seqlens_q.numel() - 1
    device = q_THD.device
    if compute_dtype is None:
        compute_dtype = exact_math_dtype(q_THD.dtype)
    # Outputs are gathered in float32 at least (float64 for float64 math), then cast to q's dtype once.
    gather_dtype = exact_math_dtype(compute_dtype)
    cu_q = cu_seqlens_q.long()
    cu_kv = cu_seqlens_kv.long()
    len_kv_B = cu_kv[1:] - cu_kv[:-1]
    # A document with queries but no key has no query rows (zero output, lse -inf), as on cuDNN.
    len_q_B = torch.where(len_kv_B > 0, cu_q[1:] - cu_q[:-1], 0)
    T_kv = k_THD.shape[0]
    # Padding slots read one appended zero row (so T = 0 works, and a NaN in a real token never
    # reaches another document through a padding slot's zero weight).
    q_THD, k_THD, v_THD = (torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in (q_THD, k_THD, v_THD))
    # One extra row collects the writes of padding slots and is dropped at the end.
    out_TD = q_THD.new_zeros(T_q + 1, H, D_v, dtype=gather_dtype)
    lse_TH = torch.full((T_q + 1, H), float("-inf"), device=device, dtype=gather_dtype)
    per_doc_bytes = torch.finfo(compute_dtype).bits // 8 * H * max(max_seqlen_q, 1) * (max(max_seqlen_kv, 1) + 1)
    chunk = max(1, _VARLEN_SCORE_BUDGET_BYTES // per_doc_bytes)
    pos_q_S = torch.arange(max_seqlen_q, device=device)
    pos_kv_S = torch.arange(max_seqlen_kv, device=device)
    for start in range(0, B, chunk):
        docs = slice(start, min(B, start + chunk))
        rows_q_CS = cu_q[docs, None] + pos_q_S
        rows_kv_CS = cu_kv[docs, None] + pos_kv_S
        valid_q_CS = pos_q_S < len_q_B[docs, None]
        valid_kv_CS = pos_kv_S < len_kv_B[docs, None]
        # Padding slots read the appended zero row (masked out below) and write the spare last row.
        gather_q_CS = torch.where(valid_q_CS, rows_q_CS, T_q)
        gather_kv_CS = torch.where(valid_kv_CS, rows_kv_CS, T_kv)
        q_CHSD = q_THD[gather_q_CS].permute(0, 2, 1, 3)
        k_CHSD = k_THD[gather_kv_CS].permute(0, 2, 1, 3)
        v_CHSD = v_THD[gather_kv_CS].permute(0, 2, 1, 3)
        o_CHSD, lse_CHS = dense_reference(
            q_CHSD,
            k_CHSD,
            v_CHSD,
            scale=scale,
            mask=mask,
            sinks_H=sinks_H,
            seqlens_q_B=len_q_B[docs],
            seqlens_kv_B=len_kv_B[docs],
            compute_dtype=compute_dtype,
        )
        scatter_CS = torch.where(valid_q_CS, rows_q_CS, T_q)
        out_TD = out_TD.index_put((scatter_CS,), o_CHSD.permute(0, 2, 1, 3).to(gather_dtype))
        lse_TH = lse_TH.index_put((scatter_CS,), lse_CHS.permute(0, 2, 1))
    return out_TD[:T_q].to(q_THD.dtype), lse_TH[:T_q]


def exact_attention(call, q, k, v, *, sinks, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a prepared call (a :class:`~cudnn_attention.call.AttentionCall` and its
    :class:`~cudnn_attention.call.Lengths`) on this exact path: the one entry of every fallback, the eager
    one and the one inside the ops (a configuration cuDNN rejects under ``torch.compile``)."""
    if call.packed:
        return varlen_reference(
            q,
            k,
            v,
            lengths.cu_seqlens_q,
            lengths.cu_seqlens_kv,
            call.max_seqlen_q,
            call.max_seqlen_kv,
            scale=call.scale,
            mask=call.mask,
            sinks_H=sinks,
        )
    out, lse = dense_reference(
        q, k, v, scale=call.scale, mask=call.mask, sinks_H=sinks, seqlens_q_B=lengths.seqlens_q, seqlens_kv_B=lengths.seqlens_kv
    )
    # A dense output adopts q's layout on every path (layouts.allocate_forward_outputs): a caller that reads the result
    # as (B, S, H, D), as FlashAttention's interface and transformers do, must get the same strides from a fallback.
    strides = like_layout_strides(tuple(out.shape), q)
    if out.stride() == strides:
        return out, lse
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device).copy_(out), lse
