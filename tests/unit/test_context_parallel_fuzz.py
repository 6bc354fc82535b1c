"""Context parallelism on random configurations: an N-rank split simulated in one process against the single-process call
on the whole row, in float64, forward and backward.

The fixed cases (``support.cp_cases``) are the shapes the design names; these draw what nobody thought of: 2 to 5 ranks,
chunks of 1 to 7 tokens, documents of any length (empty ones, ones longer than a rank's share, a tail in no document),
windows of any reach on either side (past the row too) with either alignment, sinks or none, GQA and MQA, dense batches
of one or two rows, head dims 4 to 16, and a loss over both the output and the LSE. ``CUDNN_ATTENTION_CP_FUZZ=N`` draws
N cases instead of the default.

Legend: N ranks, C tokens per zigzag chunk, T = 2 N C tokens of the row, H/H_kv query/KV heads, D head dim.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import cudnn_attention
from support.cp_cases import simulated_split

CASES = int(os.environ.get("CUDNN_ATTENTION_CP_FUZZ", "150"))


def _draw(rng: random.Random) -> dict:
    N, C = rng.randint(2, 5), rng.randint(1, 7)
    T = 2 * N * C
    H_kv = rng.choice([1, 2, 4])
    case = dict(api=rng.choice(["varlen", "dense"]), N=N, T=T, H=4, H_kv=H_kv, D=rng.choice([4, 8, 16]), B=rng.randint(1, 2))
    causal = rng.random() < 0.5
    left = rng.choice([-1, 0, 1, rng.randint(0, T + 3)])
    right = 0 if causal else rng.choice([-1, 0, 1, rng.randint(0, T + 3)])
    case["options"] = dict(causal=causal, window_size=(left, right), bottom_right=rng.random() < 0.3)
    case["sinks"] = rng.random() < 0.6
    lengths, left_over = [], T
    while left_over and rng.random() < 0.85:
        length = rng.choice([0, rng.randint(1, left_over)])
        lengths.append(length)
        left_over -= length
    case["lengths"] = lengths or [T]  # what remains past the last document is a capacity tail
    return case


def _run(case: dict, seed: int):
    """(whole results, split results): out, LSE and the gradients of one loss over both, each a float64 tensor."""
    torch.manual_seed(seed)
    api, N, T, H, H_kv, D = case["api"], case["N"], case["T"], case["H"], case["H_kv"], case["D"]
    dim = 0 if api == "varlen" else 2
    shape = (lambda h: (T, h, D)) if api == "varlen" else (lambda h: (case["B"], h, T, D))
    q, k, v = (torch.randn(*shape(h), dtype=torch.float64, requires_grad=True) for h in (H, H_kv, H_kv))
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True) if case["sinks"] else None
    cu = torch.tensor([0, *torch.tensor(case["lengths"]).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(case["lengths"])
    options = dict(case["options"], sinks=sinks, return_lse=True)

    def call(q, k, v):
        if api == "varlen":
            return cudnn_attention.varlen_attention(q, k, v, cu, cu, longest, longest, **options)
        return cudnn_attention.attention(q, k, v, **options)

    whole = call(q, k, v)
    split = simulated_split(call, q, k, v, world_size=N, dim=dim)
    weights = [torch.randn_like(t) for t in whole]
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)

    def with_grads(result):
        loss = sum((torch.where(torch.isfinite(t), t, 0) * w).sum() for t, w in zip(result, weights))
        return (*result, *torch.autograd.grad(loss, leaves))

    return with_grads(whole), with_grads(split)


@pytest.mark.parametrize("seed", range(CASES))
def test_a_random_split_gives_the_whole_calls_results(seed):
    case = _draw(random.Random(seed))
    whole, split = _run(case, seed)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), split, whole):
        # The LSE is -inf exactly where a row sees no key and no sink; elsewhere both are float64 sums in other orders.
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (name, case)
        finite_got, finite_want = torch.where(torch.isfinite(got), got, 0), torch.where(torch.isfinite(want), want, 0)
        torch.testing.assert_close(finite_got, finite_want, msg=lambda m, name=name: f"{name}, {case}: {m}")
