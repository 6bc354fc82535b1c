"""stats(), strict mode and the one-warning-per-reason rule."""

import warnings

import pytest
import torch

import cudnn_attention
from cudnn_attention import CudnnAttentionFallbackWarning, StrictModeError
from cudnn_attention.graph_build import GraphRejected
from support.graph_specs import graph_spec


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
            cudnn_attention.varlen_attention(
                q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4
            )
    finally:
        cudnn_attention.set_strict(None)
    assert not cudnn_attention.is_strict()


@pytest.mark.parametrize("value", ["yes", "false", 1, 0])
def test_strict_settings_take_a_bool_and_name_anything_else(value):
    # set_strict("false") once turned strict mode on (bool("false") is True); every mistyped value is named instead.
    with pytest.raises(TypeError, match=rf"set_strict\(\) takes True, False or None, got {value!r}"):
        cudnn_attention.set_strict(value)
    with pytest.raises(TypeError, match=rf"strict\(\) takes True or False, got {value!r}"), cudnn_attention.strict(value):
        pass
    assert not cudnn_attention.is_strict()
    assert cudnn_attention.set_strict(True) is None and cudnn_attention.set_strict(None) is True


def test_a_graph_build_or_rejection_does_not_pin_the_callers_tensors(monkeypatch):
    """Frontend 1.32 keeps a caught heuristics error in a local while it creates plans (frame ->
    error -> traceback -> frame). Built on the caller's stack, that cycle held every calling frame
    (a model forward's activations) until the cyclic GC's next full pass. And a cached rejection,
    raised as is, kept the frames of every call that raised it on its traceback."""
    import contextlib
    import gc
    import types
    import weakref

    from cudnn_attention import cudnn_graphs, graph_build

    def pygraph(**_):  # the frontend's pattern: the last mode's error kept in a local, and raised when every mode failed
        failure = None
        for mode in ("A", "FALLBACK"):
            try:
                raise RuntimeError(f"cuDNN rejects this graph: no valid engine configs for mode {mode}")
            except RuntimeError as exc:
                failure = exc
        raise failure

    frontend = types.SimpleNamespace(data_type=types.SimpleNamespace(HALF=0, BFLOAT16=1, FLOAT=2), pygraph=pygraph)
    monkeypatch.setattr(graph_build, "frontend", lambda: frontend)
    monkeypatch.setattr(graph_build, "cudnn_version", lambda: 91900)
    monkeypatch.setattr(graph_build, "bound_handle", lambda device_index: (None, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    spec = graph_spec()

    def forward_that_builds():
        activation = torch.ones(1024)  # stands for a forward's activations, alive in a calling frame
        with pytest.raises(GraphRejected, match="rejects this graph"):
            cudnn_graphs.get_graph(spec)
        return weakref.ref(activation)

    cudnn_graphs.clear_cache()
    gc.collect()
    gc.disable()
    try:
        activation = forward_that_builds()
        assert activation() is None, "the build's frame cycle keeps the calling frames' tensors alive"
        activation = forward_that_builds()  # the cached rejection, raised again
        assert activation() is None, "the cached rejection's traceback keeps the calling frames' tensors alive"
    finally:
        gc.enable()
        cudnn_graphs.clear_cache()


def test_graph_builds_and_rejections_are_counted_with_their_time(monkeypatch):
    from cudnn_attention import cudnn_graphs

    def fake_build(spec):
        if spec.batch == 3:
            raise RuntimeError("unsupported")
        return object()

    monkeypatch.setattr(cudnn_graphs, "build", fake_build)
    cudnn_graphs.clear_cache()
    cudnn_attention.reset_stats()
    base = dict(packed=True, need_lse=True)
    try:
        for direction in ("forward", "forward", "backward"):  # the second forward is a cache hit
            cudnn_graphs.get_graph(graph_spec(direction=direction, batch=1, **base))
        with pytest.raises(GraphRejected, match="unsupported"):
            cudnn_graphs.get_graph(graph_spec(direction="forward", batch=3, **base))
        builds = cudnn_attention.stats()["graph_builds"]
        assert builds["forward"] == 2 and builds["backward"] == 1 and builds["seconds"] > 0.0, builds
        cudnn_attention.reset_stats()
        assert cudnn_attention.stats()["graph_builds"] == {"forward": 0, "backward": 0, "seconds": 0.0}
    finally:
        cudnn_graphs.clear_cache()
