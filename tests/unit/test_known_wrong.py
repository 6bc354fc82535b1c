"""Graphs cuDNN builds but computes wrongly are refused like rejected ones, so their calls take the exact path (counted,
warned once) instead of returning wrong values; on CPU with a stand-in frontend, so nothing is built."""

import pytest

from cudnn_attention import cudnn_graphs, launch
from cudnn_attention.cudnn_graphs import GraphRejected, GraphSpec, known_wrong
from support.graph_specs import graph_spec


def _spec(**changes) -> GraphSpec:
    # A packed backward at D 256 with D_v 128: the corner known_wrong holds back.
    fields = dict(
        direction="backward",
        batch=4,
        heads_q=16,
        heads_kv=4,
        seq_q=256,
        seq_kv=256,
        dim_qk=256,
        dim_v=128,
        q_strides=(),
        k_strides=(),
        v_strides=(),
        o_strides=(),
        scale=0.0625,
        packed=True,
        need_lse=True,
        total_q=1024,
        total_kv=1024,
    )
    return graph_spec(**{**fields, **changes})


@pytest.mark.parametrize("dim_v", [32, 80, 128, 160, 192])
def test_the_packed_backward_at_d256_with_another_dv_is_known_wrong(dim_v):
    assert "D 256" in known_wrong(_spec(dim_v=dim_v))


@pytest.mark.parametrize(
    "changes", [dict(direction="forward"), dict(packed=False), dict(dim_v=256), dict(dim_qk=192, dim_v=80), dict(dim_qk=128, dim_v=64)]
)
def test_graphs_measured_right_are_not(changes):
    assert known_wrong(_spec(**changes)) is None


def test_a_known_wrong_graph_is_a_cached_rejection_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(launch, "frontend", lambda: object())
    monkeypatch.setattr(cudnn_graphs, "_on_a_fresh_stack", lambda *args: built.append(args))
    cudnn_graphs.clear_cache()
    spec = _spec()
    try:
        with pytest.raises(GraphRejected, match="packed backward at D 256"):
            cudnn_graphs.get_graph(spec)
        with pytest.raises(GraphRejected, match="packed backward at D 256"):  # the verdict is kept
            cudnn_graphs.get_graph(spec)
        assert not built
    finally:
        cudnn_graphs.clear_cache()
