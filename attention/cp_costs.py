"""What context parallelism costs per rank and attention layer: memory, and communication for each algorithm.

Per layer and rank, with T tokens in the whole sequence (or packed row), N ranks, Tl = T / N, H/H_kv query/KV heads,
D/Dv head dims, b bytes per element, KV = H_kv (D + Dv) b (one token's K and V):

* local activations: Tl (H D + H_kv (D + Dv) + H Dv) b for q, k, v, out, plus Tl H 4 for the float32 LSE;
* K/V buffer: the rows a rank reads keys from, transient (the forward frees it once the keys are selected; the backward
  holds its gradient until it goes back): T KV when every rank's K/V is gathered, 2C + 2w + 2r rows with a window of
  left w and right r that fits within a chunk (its own chunks and the neighbours' rows the window reaches);
* selected K/V: the keys this rank's calls read, saved for the backward. For one document filling the row: T without a
  band; T + T / 2N causal (zigzag: chunk r reads (r + 1) C keys, chunk 2N-1-r reads (2N - r) C, C = T / 2N); with a
  left window w at most 2C + 2w. :func:`costs_per_rank` takes the exact figure from the plan itself
  (:func:`~cudnn_attention.cp_sharding.plan_rank`), for the worst rank;
* workspace (estimate for cuDNN's backward): a float32 dQ accumulator and row statistics, Tl H (4 D + 8), and the
  selected keys' gradient.

Communication received per rank per layer (forward, backward):

* all-gather K/V: (N - 1) Tl KV, and the reduce-scatter of dK/dV the same;
* window exchange (a band within a chunk, what this package does then): at most 2 (w + r) KV point to point, each way;
* ring (K/V blocks passed around, TransformerEngine's p2p): (N - 1) Tl KV forward; the backward passes K/V and dK/dV,
  twice that;
* all-to-all (Ulysses, heads scattered): (N - 1) / N Tl (H D + H_kv (D + Dv) + H Dv) b each way (q, k, v in, out back;
  dO in, dq, dk, dv back); H_kv must be divisible by N (else K/V heads are repeated, which this figure leaves out).

The GPU check of these figures against measured peaks is issue 43's (``benchmarks/context_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cp_sharding import plan_rank, window_requests

__all__ = ["ALGORITHMS", "RankCosts", "costs_per_rank"]

ALGORITHMS = ("all_gather", "window_exchange", "ring", "all_to_all")


@dataclass(frozen=True)
class RankCosts:
    """One attention layer on the worst rank: bytes of memory by term, and ``communication``: ``{algorithm: (forward bytes,
    backward bytes)}`` received per rank (module docstring; ``window_exchange`` is None where the window does not fit
    within a chunk). ``algorithm``: what this package runs for this mask, ``"window_exchange"`` or ``"all_gather"``."""

    local_activations: int
    kv_buffer: int
    selected_kv: int
    workspace: int
    communication: dict
    algorithm: str

    @property
    def peak(self) -> int:
        """An upper estimate of the layer's attention bytes at once: every memory term together."""
        return self.local_activations + self.kv_buffer + self.selected_kv + self.workspace


def costs_per_rank(
    *,
    tokens: int,
    world_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    value_head_dim: int | None = None,
    dtype_bytes: int = 2,
    window_size: tuple[int, int] = (-1, 0),
) -> RankCosts:
    """Memory and communication per rank for one attention layer over one document of ``tokens`` tokens on ``world_size``
    ranks. ``window_size``: FlashAttention's ``(left, right)``; the default ``(-1, 0)`` is causal, ``(-1, -1)`` full
    attention, ``(w - 1, 0)`` transformers' sliding window of w keys."""
    if world_size < 1 or tokens < 2 * world_size or tokens % (2 * world_size):
        raise ValueError(f"tokens must be a positive multiple of 2 x world_size = {2 * world_size}, got {tokens}")
    Dv = head_dim if value_head_dim is None else value_head_dim
    N, Tl = world_size, tokens // world_size
    kv = kv_heads * (head_dim + Dv) * dtype_bytes
    left, right = window_size
    selected = max(
        plan_rank((0, tokens), length=tokens, world_size=N, rank=rank, left=left, right=right).selected_keys for rank in range(N)
    )
    requests = window_requests(tokens, N, left=left, right=right) if (left, right) != (-1, -1) else None
    fetched = None if requests is None else max(sum(stop - start for _, start, stop in wanted) for wanted in requests)
    gather = (N - 1) * Tl * kv
    all_to_all = (N - 1) * Tl * (heads * head_dim + kv_heads * (head_dim + Dv) + heads * Dv) * dtype_bytes // N
    return RankCosts(
        local_activations=Tl * (heads * head_dim + kv_heads * (head_dim + Dv) + heads * Dv) * dtype_bytes + Tl * heads * 4,
        kv_buffer=(tokens if fetched is None else Tl + fetched) * kv,
        selected_kv=selected * kv,
        workspace=Tl * heads * (4 * head_dim + 8) + selected * kv,
        communication={
            "all_gather": (gather, gather),
            "window_exchange": None if fetched is None else (fetched * kv, fetched * kv),
            "ring": (gather, 2 * gather),
            "all_to_all": (all_to_all, all_to_all),
        },
        algorithm="all_gather" if fetched is None else "window_exchange",
    )
