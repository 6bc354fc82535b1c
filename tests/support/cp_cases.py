"""The core context-parallel cases: each rank's shard of a call against the single-process call on the whole sequence.

Every rank builds the same whole-sequence inputs from the case's seed, runs the public function on them without context
parallelism (the reference), then its own zigzag shard under ``context_parallel.over(WORLD)``, and backpropagates the
same random-weighted loss over outputs and LSEs. It reports the largest error of its local outputs, LSEs and gradients
(dq, dk, dv of its shard; dsinks summed over the group) against the same positions of the reference, with each
quantity's magnitude. ``run_core_suite`` also runs the bad-input cases, each expected to raise on every rank.

Legend: N ranks, T packed tokens of the whole row, S dense sequence length, H/H_kv query/KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import cudnn_attention
from cudnn_attention import context_parallel
from cudnn_attention.cp_sharding import shard, unshard

H, H_KV, D = 4, 2, 8
CHUNK = 6  # tokens per zigzag chunk: T = 2 N CHUNK

MASKS = {
    "full": {},
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, window_size=(3, 0)),
    "bottom_right_window": dict(causal=True, bottom_right=True, window_size=(5, 0)),
    "bidirectional_window": dict(window_size=(2, 3)),
    "right_only_window": dict(window_size=(-1, 2)),
    "left_only_window": dict(window_size=(4, -1)),
}


def layouts(world_size: int) -> dict[str, tuple[int, ...]]:
    """Document lengths of a packed row of T = 2 N CHUNK tokens (a shorter sum leaves a capacity tail past the last)."""
    T = 2 * world_size * CHUNK
    return {
        # One document across every rank border: each rank's two chunks hold only parts of it.
        "one_document": (T,),
        # Documents crossing chunk borders, an empty document, and a tail of tokens in no document.
        "documents_across_borders": (5, 0, 9, 7) if world_size == 2 else (5, 0, 13, 2, 11, 9),
        # Documents end before chunk N-1: rank N-1 (chunks N-1 and N) holds only tail tokens, no document at all.
        "rank_without_documents": (4, 2) if world_size == 2 else (7, 11),
    }


@dataclass(frozen=True)
class Case:
    kind: str  # "varlen" or "dense"
    mask: str
    dtype: str
    layout: str = ""  # varlen: a layouts() key
    sinks: bool = True
    kv_heads: int = H_KV
    options: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        parts = [self.kind, self.layout, self.mask, self.dtype, "" if self.sinks else "no_sinks", "" if self.kv_heads == H_KV else "mqa"]
        return "-".join(part for part in parts if part)


def simulated_split(call, q, k, v, *, world_size: int, dim: int) -> tuple:
    """``call(q, k, v)``'s results from every rank's zigzag shard of q/k/v, an N-rank split simulated in this process
    (:class:`~cudnn_attention.context_parallel.SimulatedWorld`), put back in the row's order: what the whole call gives."""
    world = context_parallel.SimulatedWorld(world_size)
    shards = [[shard(t, world_size=world_size, rank=r, dim=dim) for r in range(world_size)] for t in (q, k, v)]
    world.share(shards[1])
    world.share(shards[2])
    parts = []
    for r in range(world_size):
        with context_parallel.over(collectives=world.rank(r)):
            parts.append(call(shards[0][r], shards[1][r], shards[2][r]))
    return tuple(unshard([part[i] for part in parts], dim=dim) for i in range(len(parts[0])))


def core_cases(world_size: int) -> list[Case]:
    cases = []
    for dtype in ("float64", "float32"):
        for mask in MASKS:
            # float32 on 4 ranks: one packed layout (the one with every feature) keeps the 4-process suite short.
            for layout in layouts(world_size) if dtype == "float64" or world_size == 2 else ["documents_across_borders"]:
                cases.append(Case("varlen", mask, dtype, layout))
            cases.append(Case("dense", mask, dtype))
    # Without sinks, and multi-query (one KV head for every query head).
    cases += [
        Case("varlen", "causal_window", "float64", "documents_across_borders", sinks=False),
        Case("dense", "causal", "float64", kv_heads=1),
    ]
    return cases


def _inputs(case: Case, world_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    T = 2 * world_size * CHUNK
    shape = (lambda h: (T, h, D)) if case.kind == "varlen" else (lambda h: (2, h, T, D))
    q, k, v = randn(*shape(H)), randn(*shape(case.kv_heads)), randn(*shape(case.kv_heads))
    sinks = randn(H) if case.sinks else None
    return q, k, v, sinks


def _call(case: Case, q, k, v, sinks, cu):
    options = dict(MASKS[case.mask], sinks=sinks, return_lse=True)
    if case.kind == "dense":
        return cudnn_attention.attention(q, k, v, **options)
    longest = max(b - a for a, b in zip(cu.tolist(), cu.tolist()[1:]))
    return cudnn_attention.varlen_attention(q, k, v, cu, cu, longest, longest, **options)


def _loss(out, lse, w_out, w_lse):
    finite = torch.isfinite(lse)
    return (out.double() * w_out).sum() + (torch.where(finite, lse, 0).double() * w_lse).sum()


def run_case(case: Case, rank: int, world_size: int, seed: int) -> dict:
    """This rank's ``{quantity: [error, magnitude]}`` (and ``lse_inf_mismatch``: rows -inf on one side only)."""
    import torch.distributed as dist

    q, k, v, sinks = _inputs(case, world_size, seed)
    dim = 0 if case.kind == "varlen" else 2
    lengths = layouts(world_size)[case.layout] if case.kind == "varlen" else ()
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None else [])
    out, lse = _call(case, *leaves[:3], leaves[3] if sinks is not None else None, cu)
    generator = torch.Generator().manual_seed(seed + 1)
    w_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=generator, dtype=torch.float64)
    reference_grads = torch.autograd.grad(_loss(out, lse, w_out, w_lse), leaves)

    def mine(t):
        return shard(t, world_size=world_size, rank=rank, dim=dim)

    local = [mine(t).detach().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None else [])
    with context_parallel.over():
        out_l, lse_l = _call(case, *local[:3], local[3] if sinks is not None else None, cu)
    grads = list(torch.autograd.grad(_loss(out_l, lse_l, mine(w_out), mine(w_lse)), local))
    if sinks is not None:
        dist.all_reduce(grads[3])  # the sinks are replicated: their gradient is the group's sum
    result = {"lse_inf_mismatch": [int((torch.isinf(lse_l) != torch.isinf(mine(lse))).sum()), 0]}
    pairs = [
        ("out", out_l, mine(out)),
        ("lse", torch.where(torch.isfinite(lse_l), lse_l, 0), mine(torch.where(torch.isfinite(lse), lse, 0))),
    ]
    pairs += [(f"d{name}", got, mine(ref)) for name, got, ref in zip("qkv", grads, reference_grads)]
    if sinks is not None:
        pairs.append(("dsinks", grads[3], reference_grads[3]))
    for name, got, ref in pairs:
        result[name] = [(got.double() - ref.double()).abs().max().item(), ref.double().abs().max().item()]
    return result


# ----------------------------------------------------------------------------------------------
# Bad input: every rank must raise (the same ValueError), none may hang
# ----------------------------------------------------------------------------------------------


def _bad_call(case: str, rank: int, world_size: int) -> None:
    last = rank == world_size - 1
    T_l = 2 * CHUNK
    q, k, v = torch.randn(T_l, H, D), torch.randn(T_l, H_KV, D), torch.randn(T_l, H_KV, D)
    T = world_size * T_l
    cu = torch.tensor([0, T], dtype=torch.int32)
    options = dict(causal=True)
    if case == "length_not_divisible":  # 3 tokens per rank: 3 N is not a multiple of 2 N
        q, k, v = q[:3], k[:3], v[:3]
        cu = torch.tensor([0, 3 * world_size], dtype=torch.int32)
    elif case == "no_tokens":
        q, k, v = q[:0], k[:0], v[:0]
        cu = torch.tensor([0], dtype=torch.int32)
    elif case == "local_shapes_differ":
        if last:
            q, k, v = (torch.cat([t, t[:2]]) for t in (q, k, v))
    elif case == "documents_differ":
        if last:
            cu = torch.tensor([0, 5, T], dtype=torch.int32)
    elif case == "masks_differ":
        if last:
            options = dict(causal=True, window_size=(3, 0))
    elif case == "bad_input_on_one_rank":
        if last:
            k = torch.randn(T_l, H_KV, D + 1)
    elif case == "cross_attention":
        cu_kv = torch.tensor([0, 4, T], dtype=torch.int32)
        with context_parallel.over():
            cudnn_attention.varlen_attention(q, k, v, cu, cu_kv, T, T, **options)
        return
    elif case == "sinks_on_some_ranks":
        options = dict(causal=True, sinks=torch.zeros(H) if rank == 0 else None)
    elif case == "requires_grad_differs":
        q.requires_grad_(rank == 0)
    elif case == "padded_dense":
        B = 2
        with context_parallel.over():
            cudnn_attention.attention(
                q.view(B, T_l // B, H, D).transpose(1, 2),
                k.view(B, T_l // B, H_KV, D).transpose(1, 2),
                v.view(B, T_l // B, H_KV, D).transpose(1, 2),
                seqlens_q=torch.tensor([T_l, 3]),
                seqlens_kv=torch.tensor([T_l, 3]),
                causal=True,
            )
        return
    else:
        raise ValueError(case)
    with context_parallel.over():
        cudnn_attention.varlen_attention(q, k, v, cu, cu, T, T, **options)


BAD_CASES = (
    "length_not_divisible",
    "no_tokens",
    "local_shapes_differ",
    "documents_differ",
    "masks_differ",
    "bad_input_on_one_rank",
    "cross_attention",
    "sinks_on_some_ranks",
    "requires_grad_differs",
    "padded_dense",
)


def run_bad_case(case: str, rank: int, world_size: int) -> dict:
    try:
        _bad_call(case, rank, world_size)
    except ValueError as error:
        return {"raised": "ValueError", "message": str(error)}
    except Exception as error:  # noqa: BLE001 - reported, the test names it
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None, "message": ""}


def run_traffic_case(rank: int, world_size: int, window_size=(-1, 0)) -> dict:
    """One causal varlen call over a single document: the bytes and key rows it moved, and what the cost model says."""
    context_parallel.reset_stats()
    T = 2 * world_size * CHUNK
    q = torch.randn(T // world_size, H, D, requires_grad=True)
    k = torch.randn(T // world_size, H_KV, D, requires_grad=True)
    v = torch.randn(T // world_size, H_KV, D, requires_grad=True)
    cu = torch.tensor([0, T], dtype=torch.int32)
    with context_parallel.over():
        out = cudnn_attention.varlen_attention(q, k, v, cu, cu, T, T, causal=True, window_size=window_size)
    out.sum().backward()
    measured = context_parallel.stats()
    costs = context_parallel.costs_per_rank(
        tokens=T, world_size=world_size, heads=H, kv_heads=H_KV, head_dim=D, dtype_bytes=4, window_size=window_size
    )
    algorithm = costs.algorithm
    forward, backward = costs.communication[algorithm]
    received = (
        measured["window_exchange_bytes"]
        if algorithm == "window_exchange"
        else measured["all_gather_bytes"] + measured["reduce_scatter_bytes"]
    )
    # The model gives the worst rank's figures: the test compares them with the largest over the ranks.
    return {
        "algorithm": algorithm,
        "received_bytes": [received, forward + backward],
        "kv_buffer_bytes": [measured["gathered_key_rows"] * H_KV * 2 * D * 4, costs.kv_buffer],
        "selected_kv_bytes": [measured["selected_key_rows"] * H_KV * 2 * D * 4, costs.selected_kv],
        "metadata_checks": [measured["metadata_checks"], 1],
    }


def run_core_suite(rank: int, world_size: int) -> dict:
    results = {case.name: run_case(case, rank, world_size, seed=index) for index, case in enumerate(core_cases(world_size))}
    results.update({f"bad-{case}": run_bad_case(case, rank, world_size) for case in BAD_CASES})
    # After every refusal the group is still in step: a good call completes and is exact.
    results["after_refusals"] = run_case(Case("varlen", "causal_window", "float64", "documents_across_borders"), rank, world_size, seed=99)
    results["traffic"] = run_traffic_case(rank, world_size)
    results["traffic_window"] = run_traffic_case(rank, world_size, window_size=(CHUNK - 1, 0))
    return results
