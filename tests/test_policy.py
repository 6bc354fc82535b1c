"""stats(), strict mode and the one-warning-per-reason rule."""

import warnings

import pytest
import torch

import cudnn_attention
from cudnn_attention import CudnnAttentionFallbackWarning, StrictModeError


def cpu_inputs(requires_grad=False):
    torch.manual_seed(0)
    return [torch.randn(1, 2, 4, 8, requires_grad=requires_grad) for _ in range(3)]


def test_stats_count_fallback_forward_and_backward_by_reason():
    q, k, v = cpu_inputs(requires_grad=True)
    cudnn_attention.attention(q, k, v, causal=True).sum().backward()
    cudnn_attention.attention(q.detach(), k.detach(), v.detach())
    stats = cudnn_attention.stats()
    assert stats["fallback_forward"] == {"cpu tensors": 2}
    assert stats["fallback_backward"] == {"cpu tensors": 1}
    assert stats["cudnn_forward"] == stats["cudnn_backward"] == 0
    cudnn_attention.reset_stats()
    assert cudnn_attention.stats()["fallback_forward"] == {}


def test_flat_stats_is_the_nested_view_in_one_level():
    from cudnn_attention.policy import flat_stats

    q, k, v = cpu_inputs(requires_grad=True)
    cudnn_attention.attention(q, k, v, causal=True).sum().backward()
    flat = flat_stats()
    assert flat["fallback_forward/cpu tensors"] == 1 and flat["fallback_backward/cpu tensors"] == 1
    assert flat["cudnn_forward"] == 0 and flat["provider/sdpa_forward"] == 0 and "graph_builds/seconds" in flat
    assert all(isinstance(value, (int, float)) for value in flat.values())


def test_device_reason_is_named():
    q, k, v = cpu_inputs()
    cudnn_attention.attention(q.to("meta"), k.to("meta"), v.to("meta"))
    assert list(cudnn_attention.stats()["fallback_forward"]) == ["meta tensors"]


def test_warns_once_per_reason():
    q, k, v = cpu_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            cudnn_attention.attention(q, k, v)
    fallback = [w for w in caught if issubclass(w.category, CudnnAttentionFallbackWarning)]
    assert len(fallback) == 1 and "cpu tensors" in str(fallback[0].message)


def test_strict_context_raises_and_restores():
    q, k, v = cpu_inputs()
    with cudnn_attention.strict():
        assert cudnn_attention.is_strict()
        with pytest.raises(StrictModeError, match=r"cuDNN cannot serve this call \(cpu tensors\)"):
            cudnn_attention.attention(q, k, v)
        with cudnn_attention.strict(False):
            cudnn_attention.attention(q, k, v)  # an inner scope can allow fallback again
    assert not cudnn_attention.is_strict()
    cudnn_attention.attention(q, k, v)
    assert cudnn_attention.stats()["fallback_forward"] == {"cpu tensors": 2}


def test_strict_global_and_env(monkeypatch):
    q, k, v = cpu_inputs()
    monkeypatch.setenv("CUDNN_ATTENTION_STRICT", "1")
    with pytest.raises(StrictModeError):
        cudnn_attention.attention(q, k, v)
    cudnn_attention.set_strict(False)  # an explicit setting wins over the environment
    try:
        cudnn_attention.attention(q, k, v)
        monkeypatch.delenv("CUDNN_ATTENTION_STRICT")
        cudnn_attention.set_strict(True)
        with pytest.raises(StrictModeError):
            cudnn_attention.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                             torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4)  # fmt: skip
    finally:
        cudnn_attention.set_strict(None)
    assert not cudnn_attention.is_strict()


def test_graph_builds_and_rejections_are_counted_with_their_time(monkeypatch):
    from cudnn_attention import cudnn_graphs

    def fake_build(spec):
        if spec.batch == 3:
            raise RuntimeError("unsupported")
        return object()

    monkeypatch.setattr(cudnn_graphs, "_build", fake_build)
    cudnn_graphs.clear_cache()
    cudnn_attention.reset_stats()
    base = dict(device_index=0, dtype=torch.bfloat16, heads_q=2, heads_kv=2, seq_q=64, seq_kv=64, dim_qk=64, dim_v=64,
                q_strides=(1,) * 4, k_strides=(1,) * 4, v_strides=(1,) * 4, o_strides=(1,) * 4, grad_strides=(), scale=0.125, left=-1,
                right=0, bottom_right=False, sinks=False, padded=False, packed=True, need_lse=True, total_q=0, total_kv=0,
                deterministic=False)  # fmt: skip
    try:
        for direction in ("forward", "forward", "backward"):  # the second forward is a cache hit
            cudnn_graphs.get_graph(cudnn_graphs.GraphSpec(direction=direction, batch=1, **base))
        with pytest.raises(cudnn_graphs.GraphRejected, match="unsupported"):
            cudnn_graphs.get_graph(cudnn_graphs.GraphSpec(direction="forward", batch=3, **base))
        builds = cudnn_attention.stats()["graph_builds"]
        assert builds["forward"] == 2 and builds["backward"] == 1 and builds["seconds"] > 0.0, builds
        cudnn_attention.reset_stats()
        assert cudnn_attention.stats()["graph_builds"] == {"forward": 0, "backward": 0, "seconds": 0.0}
    finally:
        cudnn_graphs.clear_cache()
