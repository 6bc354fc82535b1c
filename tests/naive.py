"""A per-element attention written as plainly as possible, in float64: the tests' ground truth.

It shares no code with the package: every visibility rule is spelled out again here.
"""

from __future__ import annotations

import torch


def naive_dense(q, k, v, *, scale, left=-1, right=-1, causal=False, bottom_right=False, sinks=None, len_q=None, len_kv=None):
    """q (B, H, Sq, D), k/v (B, Hkv, Skv, D) -> out (B, H, Sq, Dv) float64; rows past len_q are zero."""
    q, k, v = q.double(), k.double(), v.double()
    sinks = None if sinks is None else sinks.double()
    B, H, Sq, _ = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    if causal:
        right = 0
    rows = []
    for b in range(B):
        lq = Sq if len_q is None else int(len_q[b])
        lk = Skv if len_kv is None else int(len_kv[b])
        shift = lk - lq if bottom_right and (left >= 0 or right >= 0) else 0
        for h in range(H):
            kv_h = h // group
            for i in range(Sq):
                keys = []
                if i < lq:
                    row = i + shift
                    keys = [j for j in range(lk) if (left < 0 or j >= row - left) and (right < 0 or j <= row + right)]
                logits = [(q[b, h, i] * k[b, kv_h, j]).sum() * scale for j in keys]
                if sinks is not None and i < lq:
                    logits.append(sinks[h])
                if not logits:
                    rows.append(torch.zeros(Dv, dtype=torch.float64))
                    continue
                stacked = torch.stack(logits)
                weights = torch.softmax(stacked, dim=0)[: len(keys)]
                value_rows = torch.stack([v[b, kv_h, j] for j in keys]) if keys else torch.zeros(0, Dv, dtype=torch.float64)
                rows.append((weights[:, None] * value_rows).sum(0))
    return torch.stack(rows).view(B, H, Sq, Dv)


def naive_varlen(q, k, v, cu_q, cu_kv, **options):
    """Packed (T, H, D) -> (T, H, Dv) float64: each document through naive_dense alone; tail rows zero."""
    T, H, _ = q.shape
    Dv = v.shape[2]
    pieces = []
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_kv[b]), int(cu_kv[b + 1])
        if qe == qs:
            continue
        as_batch = [t.transpose(0, 1)[None] for t in (q[qs:qe], k[ks:ke], v[ks:ke])]
        pieces.append(naive_dense(*as_batch, **options)[0].transpose(0, 1))
    covered = int(cu_q[-1])
    pieces.append(torch.zeros(T - covered, H, Dv, dtype=torch.float64))
    return torch.cat(pieces, dim=0)
