"""CPU calls served the way cuDNN serves CUDA ones, so the remembered-call path runs without a GPU.

``resolve_cudnn`` answers with a plan of no graphs and the "kernel" is the exact path; ``counts`` says
how often each ran, so a test can tell a remembered call (no resolve) from a fresh one.
"""

from __future__ import annotations

from collections import Counter

import pytest

from cudnn_attention import api, cudnn_graphs
from cudnn_attention import plan as plans
from cudnn_attention.reference import exact_attention
from support.provider_cpu import assert_token_major


class NoGraphs:
    """A plan that holds no graphs (so the memo keeps it without a graph cache entry)."""

    specs = ()


@pytest.fixture
def served_on_cpu(monkeypatch):
    counts = Counter()

    def resolve(q, k, v, call):
        counts["resolve"] += 1
        return NoGraphs(), None

    def launch(plan, call, q, k, v, *, sinks, lengths):
        counts["launch"] += 1
        assert_token_major(q, k, v, packed=call.packed)
        return exact_attention(call, q, k, v, sinks=sinks, lengths=lengths)

    monkeypatch.setattr(plans, "resolve", resolve)
    monkeypatch.setattr(api, "cudnn_forward", launch)
    cudnn_graphs.clear_cache()
    yield counts
    cudnn_graphs.clear_cache()
