"""FlopCounterMode counts this package's ops by the pairs their masks leave, checked against an explicit boolean mask.

The ops run on meta tensors (their fake kernels serve them); index tensors on the CPU hold the values the formulas read.
The expected counts come from counting True entries of a mask built element by element here, not from the package.
"""

import functools
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import cudnn_attention
from cudnn_attention import flop_formulas

META = {"device": "meta", "dtype": torch.bfloat16}


def brute_force_pairs(lengths_q, lengths_kv, *, left=-1, right=-1, bottom_right=False) -> int:
    """True entries of each sequence's explicit (len_q, len_kv) visibility mask, summed."""
    total = 0
    for len_q, len_kv in zip(lengths_q, lengths_kv):
        mask = torch.zeros(max(len_q, 0), max(len_kv, 0), dtype=torch.bool)
        shift = len_kv - len_q if bottom_right and (left >= 0 or right >= 0) else 0
        for i in range(len_q):
            for j in range(len_kv):
                row = i + shift
                mask[i, j] = (right < 0 or j <= row + right) and (left < 0 or j >= row - left)
        total += int(mask.sum())
    return total


def forward_flops(pairs, heads, d, d_v):
    return pairs * heads * 2 * (d + d_v)


def backward_flops(pairs, heads, d, d_v):  # torch's SDPA backward: QK^T again, dO V^T, P^T dO, dS K, Q^T dS
    return pairs * heads * 2 * (3 * d + 2 * d_v)


def call_op(q, k, v, *, left=-1, right=-1, bottom_right=False, seqlens=(None, None), cu_seqlens=(None, None), maxima=(0, 0), sinks=None):
    """The forward op, every argument by name (the schema's positions may change, its names do not)."""
    indices = {"seqlens_q": seqlens[0], "seqlens_kv": seqlens[1], "cu_seqlens_q": cu_seqlens[0], "cu_seqlens_kv": cu_seqlens[1]}
    return torch.ops.cudnn_attention.forward(
        q,
        k,
        v,
        scale=0.125,
        sinks=sinks,
        **indices,
        max_seqlen_q=maxima[0],
        max_seqlen_kv=maxima[1],
        window_left=left,
        window_right=right,
        bottom_right=bottom_right,
        need_lse=True,
    )


def counted(fn, *, backward: bool):
    with FlopCounterMode(display=False) as counter:
        out, _lse = fn()
        if backward:
            out.sum().backward()
    return counter.get_flop_counts()["Global"]


# (name, B, H_q, H_kv, S_q, S_kv, D, D_v, window (left, right), bottom_right, seqlens (q, kv) or None)
DENSE_CASES = [
    ("no mask", 2, 4, 4, 16, 16, 8, 8, (-1, -1), False, None),
    ("causal", 2, 4, 4, 16, 16, 8, 8, (-1, 0), False, None),
    ("causal bottom-right, S_q < S_kv", 2, 4, 4, 5, 19, 8, 8, (-1, 0), True, None),
    ("causal top-left, S_q < S_kv", 2, 4, 4, 5, 19, 8, 8, (-1, 0), False, None),
    ("window (3, 2)", 1, 2, 2, 17, 17, 8, 8, (3, 2), False, None),
    ("window (4, 0) bottom-right, S_q > S_kv", 1, 2, 2, 23, 11, 8, 8, (4, 0), True, None),
    ("GQA 8/2, D 16, D_v 8", 2, 8, 2, 12, 12, 16, 8, (-1, 0), False, None),
    ("padded", 3, 4, 2, 16, 20, 8, 8, (-1, -1), False, ([16, 7, 0], [20, 3, 9])),
    ("padded causal bottom-right", 3, 4, 2, 16, 20, 8, 8, (-1, 0), True, ([16, 7, 5], [20, 30, 2])),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("case", DENSE_CASES, ids=[case[0] for case in DENSE_CASES])
def test_dense_counts_the_visible_pairs(case, backward):
    _, B, H, H_kv, S_q, S_kv, D, D_v, (left, right), bottom_right, seqlens = case
    q = torch.empty(B, H, S_q, D, **META, requires_grad=backward)
    k, v = torch.empty(B, H_kv, S_kv, D, **META), torch.empty(B, H_kv, S_kv, D_v, **META)
    lengths = seqlens if seqlens is not None else ([S_q] * B, [S_kv] * B)
    # The kernels clamp a padded batch's lengths to the tensor (a length of 30 keys reads 20).
    clamped_q, clamped_kv = [min(n, S_q) for n in lengths[0]], [min(n, S_kv) for n in lengths[1]]
    pairs = brute_force_pairs(clamped_q, clamped_kv, left=left, right=right, bottom_right=bottom_right)
    index = (None, None) if seqlens is None else tuple(torch.tensor(n, dtype=torch.int32) for n in seqlens)
    counts = counted(lambda: call_op(q, k, v, left=left, right=right, bottom_right=bottom_right, seqlens=index), backward=backward)
    assert pairs > 0
    assert counts.pop(torch.ops.cudnn_attention.forward) == forward_flops(pairs, H, D, D_v)
    if backward:
        assert counts.pop(torch.ops.cudnn_attention.backward) == backward_flops(pairs, H, D, D_v)
    assert not counts, counts


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 1)], ids=["no mask", "causal", "window (2, 1)"])
@pytest.mark.parametrize("bottom_right", [False, True], ids=["top-left", "bottom-right"])
def test_packed_counts_each_document(window, bottom_right, backward):
    # Documents of different query and key lengths, an empty one, one with queries but no key, and a capacity tail of
    # tokens in no document (the last 3 query and 2 key tokens).
    docs_q, docs_kv = [5, 0, 9, 3, 1], [7, 4, 9, 0, 6]
    T_q, T_kv, H, H_kv, D, D_v = sum(docs_q) + 3, sum(docs_kv) + 2, 4, 2, 16, 8
    cu = [torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32) for docs in (docs_q, docs_kv)]
    q = torch.empty(T_q, H, D, **META, requires_grad=backward)
    k, v = torch.empty(T_kv, H_kv, D, **META), torch.empty(T_kv, H_kv, D_v, **META)
    left, right = window
    counts = counted(
        lambda: call_op(q, k, v, left=left, right=right, bottom_right=bottom_right, cu_seqlens=cu, maxima=(9, 9)), backward=backward
    )
    pairs = brute_force_pairs(docs_q, docs_kv, left=left, right=right, bottom_right=bottom_right)
    assert counts[torch.ops.cudnn_attention.forward] == forward_flops(pairs, H, D, D_v)
    if backward:
        assert counts[torch.ops.cudnn_attention.backward] == backward_flops(pairs, H, D, D_v)


def test_sinks_add_no_products():
    q, k, v = (torch.empty(1, 4, 8, 8, **META) for _ in range(3))
    plain = counted(lambda: call_op(q, k, v, right=0), backward=False)
    with_sinks = counted(lambda: call_op(q, k, v, right=0, sinks=torch.empty(4, device="meta")), backward=False)
    assert with_sinks == plain and plain[torch.ops.cudnn_attention.forward] == forward_flops(brute_force_pairs([8], [8], right=0), 4, 8, 8)


def test_index_tensors_without_values_give_the_documented_upper_bound():
    # Padded: every sequence at full length.
    q, k, v = torch.empty(2, 4, 16, 8, **META), torch.empty(2, 2, 20, 8, **META), torch.empty(2, 2, 20, 8, **META)
    lengths = (torch.empty(2, dtype=torch.int32, device="meta"),) * 2
    counts = counted(lambda: call_op(q, k, v, right=0, bottom_right=True, seqlens=lengths), backward=False)
    assert counts[torch.ops.cudnn_attention.forward] == forward_flops(
        brute_force_pairs([16, 16], [20, 20], right=0, bottom_right=True), 4, 8, 8
    )
    # Packed: the smaller of (every document at its maximum) and (query tokens, at most documents x max, x widest row).
    cu = (torch.empty(4, dtype=torch.int32, device="meta"),) * 2
    for window, max_q, max_kv, tokens in [((-1, 0), 6, 6, 50), ((-1, 0), 16, 16, 20), ((3, 1), 16, 16, 40)]:
        q, k, v = torch.empty(tokens, 4, 8, **META), torch.empty(tokens, 2, 8, **META), torch.empty(tokens, 2, 8, **META)
        counts = counted(
            functools.partial(call_op, q, k, v, left=window[0], right=window[1], cu_seqlens=cu, maxima=(max_q, max_kv)), backward=False
        )
        widest = min(max_kv, window[0] + window[1] + 1) if min(window) >= 0 else max_kv
        bound = min(3 * brute_force_pairs([max_q], [max_kv], left=window[0], right=window[1]), min(tokens, 3 * max_q) * widest)
        assert counts[torch.ops.cudnn_attention.forward] == forward_flops(bound, 4, 8, 8), (window, max_q, max_kv, tokens)


def test_public_functions_on_meta_tensors_are_counted_by_their_masks():
    # measure_flops builds its model on meta: the public functions must reach the op there (the exact path's matrix
    # products would count every pair, causal or not), forward and backward.
    q = torch.empty(2, 4, 32, 16, **META, requires_grad=True)
    k, v = torch.empty(2, 2, 32, 16, **META), torch.empty(2, 2, 32, 16, **META)
    with FlopCounterMode(display=False) as counter:
        cudnn_attention.attention(q, k, v, causal=True, window_size=(5, 0)).sum().backward()
    pairs = brute_force_pairs([32, 32], [32, 32], left=5, right=0)
    assert counter.get_flop_counts()["Global"] == {
        torch.ops.cudnn_attention.forward: forward_flops(pairs, 4, 16, 16),
        torch.ops.cudnn_attention.backward: backward_flops(pairs, 4, 16, 16),
    }
    # Packed: the prefix sums are meta too, so the documented bound (here every document at its maximum).
    q = torch.empty(30, 4, 16, **META, requires_grad=True)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    with FlopCounterMode(display=False) as counter:
        cudnn_attention.varlen_attention(q, q, q, cu, cu, 10, 10, causal=True).sum().backward()
    pairs = 2 * brute_force_pairs([10], [10], right=0)
    assert counter.get_total_flops() == forward_flops(pairs, 4, 16, 16) + backward_flops(pairs, 4, 16, 16)


def test_lightning_measure_flops():
    throughput = pytest.importorskip("lightning.fabric.utilities.throughput")

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(64, 3 * 64, bias=False)

        def forward(self, x_BSE):
            q, k, v = self.qkv(x_BSE).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4)
            return cudnn_attention.attention(q, k, v, causal=True)

    with torch.device("meta"):
        model = Attention().to(torch.bfloat16)
        x = torch.empty(2, 24, 64, dtype=torch.bfloat16)
    projection = 2 * (2 * 24) * 64 * (3 * 64)  # one (48, 64) x (64, 192) product
    pairs = brute_force_pairs([24, 24], [24, 24], right=0)
    assert throughput.measure_flops(model, lambda: model(x)) == projection + forward_flops(pairs, 4, 16, 16)
    # Backward: the projection's weight gradient (its input needs none), and the attention backward.
    total = throughput.measure_flops(model, lambda: model(x), lambda out: out.sum())
    assert total == 2 * projection + forward_flops(pairs, 4, 16, 16) + backward_flops(pairs, 4, 16, 16)


def test_pairs_formula_matches_brute_force():
    rng = random.Random(0)
    for _ in range(400):
        len_q, len_kv = rng.randint(0, 9), rng.randint(0, 9)
        left, right, bottom_right = rng.randint(-1, 10), rng.randint(-1, 10), rng.random() < 0.5
        want = brute_force_pairs([len_q], [len_kv], left=left, right=right, bottom_right=bottom_right)
        got = flop_formulas.attention_pairs(
            lengths_q=[len_q], lengths_kv=[len_kv], window_left=left, window_right=right, bottom_right=bottom_right
        )
        assert got == want, (len_q, len_kv, left, right, bottom_right)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_formulas_count_is_causal(causal):
    B, H, H_kv, S, D = 2, 4, 2, 24, 16
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D, requires_grad=True)
    k, v = torch.randn(B, H_kv, S, D), torch.randn(B, H_kv, S, D)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas.sdpa_flop_formulas()) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).sum().backward()
    pairs = brute_force_pairs([S] * B, [S] * B, right=0 if causal else -1)
    assert counter.get_total_flops() == forward_flops(pairs, H, D, D) + backward_flops(pairs, H, D, D)


def test_sdpa_masks_counted_is_scoped():
    from torch.utils.flop_counter import flop_registry

    before = dict(flop_registry)
    q = torch.randn(1, 2, 16, 8)
    with flop_formulas.sdpa_masks_counted(), FlopCounterMode(display=False) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert counter.get_total_flops() == forward_flops(brute_force_pairs([16], [16], right=0), 2, 8, 8)
    assert flop_registry == before


def test_register_is_idempotent():
    from torch.utils.flop_counter import flop_registry

    flop_formulas.register()
    assert flop_registry[torch.ops.cudnn_attention.forward] is flop_formulas.forward_flops
    assert flop_registry[torch.ops.cudnn_attention.backward] is flop_formulas.backward_flops


@pytest.mark.gpu
def test_gpu_calls_served_by_cudnn_are_counted_from_their_device_lengths():
    # On a GPU the op runs its cuDNN kernels under the counter, and the formula reads the CUDA prefix sums.
    docs = [100, 1, 37, 118]
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(docs), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(docs), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cudnn_attention.reset_stats()
    with FlopCounterMode(display=False) as counter:
        cudnn_attention.varlen_attention(q, k, v, cu, cu, max(docs), max(docs), window_size=(64, 0)).sum().backward()
    pairs = brute_force_pairs(docs, docs, left=64, right=0)
    assert counter.get_flop_counts()["Global"] == {
        torch.ops.cudnn_attention.forward: forward_flops(pairs, 8, 128, 128),
        torch.ops.cudnn_attention.backward: backward_flops(pairs, 8, 128, 128),
    }
    assert cudnn_attention.stats()["cudnn_forward"] == 1 and cudnn_attention.stats()["cudnn_backward"] == 1
