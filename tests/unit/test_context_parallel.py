"""Context parallelism on CPUs: 2 and 4 gloo processes against the single-process result, the sharding and planning
functions, the one-process simulated split, and what the layer refuses.

The multi-process cases run once per world size (``support.cp_launch.run_suite``: one start of N processes for every
case, ``support.cp_cases``); each case's test reads its results. Every rank compares its local outputs, LSEs and
gradients (dq, dk, dv of its shard, dsinks summed over the group) with the same positions of the public function's
result on the whole sequence in one process: equal within the dtype's rounding (64 ulps of the magnitude).
"""

from __future__ import annotations

import itertools
import random
import sys

import pytest
import torch

import cudnn_attention
from cudnn_attention import context_parallel, cp_state
from cudnn_attention.cp_sharding import check_shardable, gather_rows, plan_rank, shard, shard_positions, unshard
from support.cp_cases import BAD_CASES, MASKS, core_cases, simulated_split
from support.cp_launch import run_suite

WORLD_SIZES = (2, 4)
ULPS = 64
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo process groups")


_SUITES: dict[int, dict] = {}


def _results(world_size: int) -> dict:
    """The suite's results on ``world_size`` ranks, run once per test session (the first test that needs them)."""
    if world_size not in _SUITES:
        _SUITES[world_size] = run_suite("core", world_size)
    return _SUITES[world_size]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}_ranks")
def suite(request):
    return request.param, _results(request.param)


def _tolerance(case_name: str) -> float:
    return ULPS * torch.finfo(torch.float32 if "float32" in case_name else torch.float64).eps


def _assert_exact(name: str, per_rank: list[dict]) -> None:
    tolerance = _tolerance(name)
    for rank, result in enumerate(per_rank):
        assert result["lse_inf_mismatch"] == [0, 0], f"{name}, rank {rank}: -inf LSE rows differ from the single process's"
        for quantity, (error, magnitude) in result.items():
            assert quantity == "lse_inf_mismatch" or error <= tolerance * max(magnitude, 1.0), (
                f"{name}, rank {rank}: {quantity} off by {error:.3g} (|ref| {magnitude:.3g})"
            )


CASES = [(n, case.name) for n in WORLD_SIZES for case in core_cases(n)]


@pytest.mark.parametrize("world_size, case", CASES, ids=[f"{n}_ranks-{case}" for n, case in CASES])
def test_every_rank_matches_the_single_process_forward_and_backward(world_size, case):
    _assert_exact(f"{world_size} ranks, {case}", _results(world_size)[case])


# Where each refusal comes from: a check one rank makes alone (its message reaches every rank), the comparison of the
# ranks' calls, or the shared length check after it.
EXPECTED_REFUSALS = {
    "length_not_divisible": "not divisible by 2 x",
    "no_tokens": "has 0 tokens",
    "local_shapes_differ": "disagree on local shape of q",
    "documents_differ": "disagree on documents (cu_seqlens)",
    "masks_differ": "disagree on window (left, right)",
    "bad_input_on_one_rank": "bad input on rank {last}",
    "cross_attention": "serves self-attention",
    "sinks_on_some_ranks": "disagree on sinks shape",
    "requires_grad_differs": "disagree on requires_grad",
    "padded_dense": "padded dense batches",
}


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_the_same_error_on_every_rank_without_a_hang(suite, case):
    world_size, results = suite
    per_rank = results[f"bad-{case}"]
    expected = EXPECTED_REFUSALS[case].format(last=world_size - 1)
    for rank, result in enumerate(per_rank):
        assert result["raised"] == "ValueError", f"rank {rank}: {result}"
        assert expected in result["message"], f"rank {rank}: {result['message']}"
    assert len({result["message"] for result in per_rank}) == 1, [result["message"] for result in per_rank]


def test_the_group_stays_in_step_after_the_refusals(suite):
    world_size, results = suite
    _assert_exact(f"{world_size} ranks, after the refusals", results["after_refusals"])


@pytest.mark.parametrize("traffic, algorithm", [("traffic", "all_gather"), ("traffic_window", "window_exchange")])
def test_traffic_and_buffers_are_what_the_cost_model_says(suite, traffic, algorithm):
    world_size, results = suite
    per_rank = results[traffic]
    assert {result["algorithm"] for result in per_rank} == {algorithm}
    # The model gives the worst rank's figures (under the window exchange the first and last chunks' ranks fetch less).
    for name in ("received_bytes", "kv_buffer_bytes", "selected_kv_bytes", "metadata_checks"):
        measured = [result[name][0] for result in per_rank]
        assert max(measured) == per_rank[0][name][1], f"{name}: measured per rank {measured}, modelled {per_rank[0][name][1]}"


# ----------------------------------------------------------------------------------------------
# In one process: sharding, plans, the simulated split
# ----------------------------------------------------------------------------------------------


def test_zigzag_shards_cover_the_row_once_and_unshard_restores_it():
    x = torch.arange(24.0).view(24, 1)
    shards = [shard(x, world_size=3, rank=r, dim=0) for r in range(3)]
    assert shards[0].view(-1).tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5 of 6
    assert shards[1].view(-1).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert torch.equal(unshard(shards, dim=0), x)
    assert torch.equal(torch.cat(shards)[gather_rows(24, 3)], x)
    assert sorted(torch.cat([shard_positions(24, 3, r) for r in range(3)]).tolist()) == list(range(24))


def test_causal_work_is_balanced_across_ranks():
    # Visible (query, key) pairs per rank of one causal document: equal on every rank under the zigzag.
    T, N = 64, 4
    work = [sum(p + 1 for p in shard_positions(T, N, r).tolist()) for r in range(N)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("length, world_size", [(6, 2), (0, 2), (10, 4)])
def test_a_row_that_cannot_be_cut_is_refused_with_its_length_and_the_rank_count(length, world_size):
    with pytest.raises(ValueError, match=f"has {length} tokens") as error:
        check_shardable(length, world_size)
    assert str(2 * world_size) in str(error.value)


def _visible_by_plan(plan, cu) -> set:
    """Every (query position, key position) pair the plan's calls compute, each pair counted once (asserted)."""
    positions = shard_positions(plan.length, plan.world_size, plan.rank).tolist()
    pairs = set()
    for call in plan.calls:
        for doc, (start, stop) in enumerate(call.key_ranges):
            queries = positions[call.cu_q[doc] : call.cu_q[doc + 1]]
            n_q, n_k = len(queries), stop - start
            left, right = call.window
            for i, p in enumerate(queries):
                row = i + (n_k - n_q if call.bottom_right else 0)
                for j in range(n_k):
                    if (right < 0 or j <= row + right) and (left < 0 or j >= row - left):
                        assert (p, start + j) not in pairs, f"pair {(p, start + j)} computed twice"
                        pairs.add((p, start + j))
    return pairs


def _visible_whole(cu, T, left, right, positions) -> set:
    doc_of = {}
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        doc_of.update(dict.fromkeys(range(a, b), d))
    return {
        (p, j)
        for p in positions
        for j in range(T)
        if p in doc_of and doc_of.get(j) == doc_of[p] and (right < 0 or j <= p + right) and (left < 0 or j >= p - left)
    }


def test_each_rank_plan_computes_exactly_the_pairs_the_whole_mask_allows():
    # Brute force over random documents (empty ones and tails included) and every window kind: the union of a rank's
    # calls is its queries' visible set, each pair once (a pair in both of a band's two calls would count a key twice).
    rng = random.Random(0)
    windows = [(-1, -1), (-1, 0), (0, 0), (3, 0), (2, 3), (-1, 2), (4, -1), (7, 1)]
    for trial in range(30):
        N = rng.choice([1, 2, 3, 4])
        T = 2 * N * rng.randint(1, 4)
        lengths = []
        while sum(lengths) < T and rng.random() < 0.85:
            lengths.append(min(rng.choice([0, 1, 2, 5, 9, 13]), T - sum(lengths)))
        cu = tuple(itertools.accumulate([0, *lengths]))
        for (left, right), rank in itertools.product(windows, range(N)):
            plan = plan_rank(cu, length=T, world_size=N, rank=rank, left=left, right=right)
            assert sum(call.with_sinks for call in plan.calls) == 1
            expected = _visible_whole(cu, T, left, right, shard_positions(T, N, rank).tolist())
            assert _visible_by_plan(plan, cu) == expected, (cu, T, N, rank, left, right)


def test_causal_plans_read_T_plus_a_chunk_of_keys_and_full_ones_T():
    T, N = 48, 4
    for rank in range(N):
        assert plan_rank((0, T), length=T, world_size=N, rank=rank, left=-1, right=0).selected_keys == T + T // (2 * N)
        assert plan_rank((0, T), length=T, world_size=N, rank=rank, left=-1, right=-1).selected_keys == T
    costs = context_parallel.costs_per_rank(tokens=T, world_size=N, heads=4, kv_heads=2, head_dim=8, dtype_bytes=2)
    assert costs.selected_kv == (T + T // (2 * N)) * 2 * 16 * 2
    assert costs.kv_buffer == T * 2 * 16 * 2 and costs.algorithm == "all_gather"
    assert costs.communication["all_gather"] == ((N - 1) * (T // N) * 2 * 16 * 2,) * 2
    window = context_parallel.costs_per_rank(tokens=T, world_size=N, heads=4, kv_heads=2, head_dim=8, dtype_bytes=2, window_size=(3, 0))
    # Own chunks (T / N) plus 3 keys before each chunk, from the neighbours; the same 3 + 3 rows go each way.
    assert window.algorithm == "window_exchange" and window.kv_buffer == (T // N + 6) * 2 * 16 * 2
    assert window.communication["window_exchange"] == (6 * 2 * 16 * 2,) * 2


def _simulated(api: str, N: int, options: dict, *, dtype=torch.float64, seed=0):
    """(whole result, split result, whole grads, split grads) of one call, the split simulated in this process."""
    torch.manual_seed(seed)
    dim = 0 if api == "varlen" else 2
    T = 2 * N * 5
    shape = (lambda h: (T, h, 8)) if api == "varlen" else (lambda h: (2, h, T, 8))
    q, k, v = (torch.randn(*shape(h), dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, 7, 7, 23, T - 3], dtype=torch.int32)

    def call(q, k, v):
        if api == "varlen":
            return cudnn_attention.varlen_attention(q, k, v, cu, cu, 16, 16, sinks=sinks, return_lse=True, **options)
        return cudnn_attention.attention(q, k, v, sinks=sinks, return_lse=True, **options)

    whole = call(q, k, v)
    split = simulated_split(call, q, k, v, world_size=N, dim=dim)
    weights = [torch.randn_like(t) for t in whole]

    def grads(result):
        loss = sum((torch.where(torch.isfinite(t), t, 0) * w).sum() for t, w in zip(result, weights))
        return torch.autograd.grad(loss, (q, k, v, sinks))

    return whole, split, grads(whole), grads(split)


@pytest.mark.parametrize("api", ["varlen", "dense"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_the_simulated_split_in_one_process_matches_the_whole_call(api, mask):
    whole, split, whole_grads, split_grads = _simulated(api, 3, MASKS[mask])
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (*split, *split_grads), (*whole, *whole_grads)):
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), name
        torch.testing.assert_close(torch.where(torch.isfinite(got), got, 0), torch.where(torch.isfinite(ref), ref, 0), msg=name)


def test_merge_of_partials_is_attention_over_the_union_and_keeps_empty_rows_empty():
    torch.manual_seed(0)
    scores = torch.randn(3, 2, 5, dtype=torch.float64)
    values = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    visible = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)[:, None].expand(3, 2, 5)

    def attend(mask):
        s = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.where(mask, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None]), 0)
        return (p[..., None] * values).sum(-2), lse

    first = visible & (torch.arange(5) < 2)
    out, lse = context_parallel.merge_partials(*attend(first), *attend(visible & ~first))
    ref_out, ref_lse = attend(visible)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.isinf(lse[1]).all() and not out[1].any()


def test_over_is_reversible_and_only_its_block_is_context_parallel():
    world = context_parallel.SimulatedWorld(1)
    assert context_parallel.active() is None and cp_state.active is None
    handle = context_parallel.over(collectives=world.rank(0))
    assert context_parallel.active() is None  # made, not entered
    with handle:
        assert context_parallel.active() is handle
        inner = context_parallel.over(collectives=world.rank(0))
        with inner:
            assert context_parallel.active() is inner
        assert context_parallel.active() is handle
    assert context_parallel.active() is None
    with pytest.raises(RuntimeError), handle:
        raise RuntimeError("leaves the block")
    assert context_parallel.active() is None


def test_over_a_process_group_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        context_parallel.over()
    with pytest.raises(TypeError, match="Collectives"):
        context_parallel.over(collectives=object())
