"""Adversarial attention data: query rows anti-aligned with every key, so that each score of the row is very negative
and its log-sum-exp falls below -88.7 (``exp`` of the key tail's unmasked zero score overflows float32 there, see
``cudnn_attention.errata``), as in the "massive activation" heads of real models. Random normal data gives
``lse ~ log(S_kv) > 0``, about 100 away from that threshold, so a fuzz without this draw never meets such rows.

One coordinate of the head dim carries it: every key holds ``-KEY_VALUE`` there, the chosen query rows hold the value
that puts their scores near ``-target``, the other rows hold 0 (their scores keep the normal spread of the remaining
coordinates). Legend: T tokens, B batch, H heads, S sequence, D head dim.
"""

from __future__ import annotations

import torch

__all__ = ["KEY_VALUE", "anti_align"]

KEY_VALUE = 8.0  # exact in float16 and bfloat16, as is every query value below for targets of a few hundred


@torch.no_grad()
def anti_align(q: torch.Tensor, k: torch.Tensor, *, scale: float, target: float, rows: str, generator: torch.Generator, packed: bool):
    """Turn ``rows`` (``"all"``, ``"some"``: about a quarter, ``"one"``) of the queries into rows whose every score is about
    ``-target`` (before the softmax; ``scale`` the call's positive scale), in place (views write through to their buffer).
    ``q``/``k``: dense (B, H, S, D) or packed (T, H, D). Returns the (S,) or (T,) bool mask of the rows changed."""
    row_dim = 0 if packed else 2
    count = q.shape[row_dim]
    if rows == "all":
        chosen = torch.ones(count, dtype=torch.bool)
    elif rows == "some":
        chosen = torch.rand(count, generator=generator) < 0.25
    else:
        chosen = torch.zeros(count, dtype=torch.bool)
        if count:
            chosen[torch.randint(count, (1,), generator=generator)] = True
    query_value = target / (KEY_VALUE * abs(scale))
    column = torch.where(chosen, query_value, 0.0).to(device=q.device, dtype=q.dtype)
    shape = [1] * q.dim()
    shape[row_dim] = count
    # Through ``.data``, which shares the storage but not the version counter: q and k may be views that autograd forbids
    # writing (unbind's outputs), and nothing has been computed from them yet.
    q.data[..., 0] = column.view(shape[:-1])
    k.data[..., 0] = -KEY_VALUE
    return chosen
