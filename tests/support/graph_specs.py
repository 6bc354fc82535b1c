"""A :class:`~cudnn_attention.graph_spec.GraphSpec` for tests that exercise the cache, its memo or its verdicts without a
frontend: one small causal bf16 forward graph, with whatever fields a test changes."""

from __future__ import annotations

import torch

from cudnn_attention.graph_spec import GraphSpec
from cudnn_attention.masking import MaskSpec

__all__ = ["graph_spec"]


def graph_spec(**changes) -> GraphSpec:
    """A forward graph of B 1, H 2, S 64, D 64, causal, scale 0.125, with ``changes`` applied (any GraphSpec field)."""
    fields = dict(
        direction="forward",
        device_index=0,
        dtype=torch.bfloat16,
        batch=1,
        heads_q=2,
        heads_kv=2,
        seq_q=64,
        seq_kv=64,
        dim_qk=64,
        dim_v=64,
        q_strides=(1,) * 4,
        k_strides=(1,) * 4,
        v_strides=(1,) * 4,
        o_strides=(1,) * 4,
        scale=0.125,
        mask=MaskSpec(-1, 0),
    )
    return GraphSpec(**{**fields, **changes})
