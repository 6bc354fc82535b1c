"""The errata table (``cudnn_attention.errata``): which graphs each known cuDNN bug affects on which versions, and what
the package does about it: build another graph that computes the same (a reroute) or refuse the graph (the exact path
serves it). On CPU with a stand-in frontend version, so nothing is built; the GPU half is tests/gpu/test_gpu_errata.py."""

import pytest
import torch

from cudnn_attention import cudnn_graphs, doctor, errata, graph_build, operands
from cudnn_attention import graph_spec as graph_specs
from cudnn_attention.call import AttentionCall, Lengths
from cudnn_attention.graph_build import GraphRejected
from cudnn_attention.graph_spec import spec_for
from cudnn_attention.masking import MaskSpec
from support.graph_specs import graph_spec

V919, V926 = 91900, 92600
FULL, CAUSAL, LEFT_WINDOW, WIDE_BAND = MaskSpec(), MaskSpec(-1, 0), MaskSpec(128, -1), MaskSpec(8, 100)


def _backward(**changes):
    return graph_spec(**{"direction": "backward", "mask": FULL, **changes})


def _key(spec, version):
    erratum = errata.matching(spec, version)
    return None if erratum is None else erratum.key


@pytest.mark.parametrize("seq_kv", [64, 192, 320, 576, 1088])
@pytest.mark.parametrize("mask", [FULL, LEFT_WINDOW])
def test_dense_unpadded_backward_at_kv_64_mod_128_is_rerouted_before_9_26(seq_kv, mask):
    spec = _backward(seq_q=seq_kv, seq_kv=seq_kv, mask=mask)
    assert _key(spec, V919) == "dq-nan-kv-64-mod-128" and errata.matching(spec, V919).action == errata.REROUTE
    assert _key(spec, V926) is None


@pytest.mark.parametrize(
    "changes",
    [
        dict(seq_kv=128),
        dict(seq_kv=200),
        dict(seq_kv=512),
        dict(padded=True),
        dict(packed=True),
        dict(direction="forward"),
        dict(mask=CAUSAL),  # the causal tiles mask the key tail
        dict(mask=MaskSpec(-1, 0, True), seq_q=100),  # bottom-right causal: the last diagonal is the last key
        dict(mask=MaskSpec(16, 3), seq_q=100),  # a right bound that stops before the tail
    ],
)
def test_graphs_measured_clean_or_masking_the_tail_are_left_alone(changes):
    spec = _backward(**{"seq_q": 192, "seq_kv": 192, **changes})
    assert _key(spec, V919) is None


@pytest.mark.parametrize(
    "mask, seq_q", [(MaskSpec(-1, 0), 300), (WIDE_BAND, 192), (MaskSpec(8, 1), 192)]
)  # causal with more queries than keys, bands reaching the tail
def test_bands_that_reach_the_key_tail_are_rerouted(mask, seq_q):
    assert _key(_backward(seq_q=seq_q, seq_kv=192, mask=mask), V919) == "dq-nan-kv-64-mod-128"


def test_a_single_query_row_is_rerouted_on_every_version_and_refused_where_everything_is_one():
    one_query = _backward(batch=2, heads_q=2, seq_q=1, seq_kv=128)
    for version in (V919, 92501, V926):  # 9.19 too: seen on the H200 on 2026-12-05
        assert _key(one_query, version) == "dkdv-nan-single-query"
    everything_one = _backward(batch=1, heads_q=1, heads_kv=1, seq_q=1, seq_kv=128)
    # A crash outranks a NaN: the refusal wins over the reroute.
    assert _key(everything_one, V926) == "bwd-plan-segfault-b1-h1-s1" and errata.matching(everything_one, V926).action == errata.REFUSE


@pytest.mark.parametrize("dim_v", [32, 80, 128, 160, 192])
def test_the_packed_backward_at_d256_with_another_dv_is_refused_on_every_version(dim_v):
    spec = _backward(packed=True, dim_qk=256, dim_v=dim_v, seq_q=256, seq_kv=256)
    for version in (V919, V926, None):
        assert _key(spec, version) == "packed-d256-other-dv-backward"


def test_a_packed_backward_holding_the_sinks_is_refused_before_9_26_and_no_call_builds_one(monkeypatch):
    # TransformerEngine#3249: wrong dSink / out-of-bounds statistics. Only benchmarks/sink_backward.py asks for such a graph:
    # calls hold the sinks in a dense backward only (graph_spec.dsink_in_graph), whatever the version.
    spec = _backward(packed=True, sinks=True, seq_q=256, seq_kv=256)
    assert _key(spec, V919) == "packed-sinks-backward-stats" and errata.matching(spec, V919).action == errata.REFUSE
    assert _key(spec, V926) is None and _key(spec._replace(packed=False), V919) is None
    call = AttentionCall(packed=True, max_seqlen_q=256, max_seqlen_kv=256, scale=0.125, mask=CAUSAL, need_lse=True, has_sinks=True)
    q = k = v = torch.empty(512, 2, 64, dtype=torch.bfloat16)
    for version in (V919, V926, 92801, 99999):
        monkeypatch.setattr(graph_specs, "cudnn_version", lambda version=version: version)
        assert not spec_for("backward", call, q, k, v, deterministic=False).sinks
        assert spec_for("forward", call, q, k, v, deterministic=False).sinks


@pytest.mark.parametrize(
    ("version", "padded", "deterministic", "holds"),
    [
        (92801, False, False, True),
        (93000, False, False, True),
        (92800, False, False, False),
        (V919, False, False, False),
        (None, False, False, False),
        (92801, True, False, False),
        (92801, False, True, False),
    ],
)
def test_a_dense_backward_holds_the_sinks_from_9_28_1_unpadded_and_nondeterministic(version, padded, deterministic, holds, monkeypatch):
    # Measured faster than the sink-less backward plus the pass on 9.28.1 only (docs/decisions/0025); padded calls and the
    # deterministic algorithm were not measured.
    monkeypatch.setattr(graph_specs, "cudnn_version", lambda: version)
    call = AttentionCall(packed=False, padded=padded, max_seqlen_q=256, max_seqlen_kv=256, scale=0.125, mask=CAUSAL, has_sinks=True)
    q = k = v = torch.empty(2, 4, 256, 64, dtype=torch.bfloat16)
    assert spec_for("backward", call, q, k, v, deterministic=deterministic).sinks == holds
    assert spec_for("forward", call, q, k, v, deterministic=deterministic).sinks
    assert not spec_for("backward", call.replace(has_sinks=False), q, k, v, deterministic=deterministic).sinks


def _dense_call(S_q, S_kv, mask, *, padded=False):
    q = torch.empty(2, 4, S_q, 64, dtype=torch.bfloat16)
    k = v = torch.empty(2, 2, S_kv, 64, dtype=torch.bfloat16)
    call = AttentionCall(packed=False, padded=padded, max_seqlen_q=S_q, max_seqlen_kv=S_kv, scale=0.125, mask=mask, need_lse=True)
    return call, q, k, v


def test_spec_for_builds_the_padded_variant_on_affected_versions_only(monkeypatch):
    call, q, k, v = _dense_call(576, 576, FULL)  # a vision tower's 576 patches
    monkeypatch.setattr(graph_specs, "cudnn_version", lambda: V919)
    rerouted = spec_for("backward", call, q, k, v, deterministic=False)
    assert rerouted.padded and not spec_for("forward", call, q, k, v, deterministic=False).padded
    assert rerouted == spec_for("backward", call.replace(padded=True), q, k, v, deterministic=False)  # the same graph
    monkeypatch.setattr(graph_specs, "cudnn_version", lambda: V926)
    assert not spec_for("backward", call, q, k, v, deterministic=False).padded


def test_an_unpadded_call_on_a_padded_graph_passes_full_lengths_once_made():
    class Graph:
        full_lengths = (3, 5, 7)

    first = operands.length_operands(Graph(), Lengths(), torch.device("cpu"))
    assert [t.tolist() for t in first] == [[5, 5, 5], [7, 7, 7]] and all(t.dtype == torch.int32 for t in first)
    again = operands.length_operands(Graph(), Lengths(), torch.device("cpu"))
    assert all(a is b for a, b in zip(first, again))  # made once, not per call


def test_refused_graphs_are_cached_rejections_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(graph_build, "frontend", lambda: object())
    monkeypatch.setattr(graph_build, "cudnn_version", lambda: V926)
    monkeypatch.setattr(graph_build, "_on_a_fresh_stack", lambda *args: built.append(args))
    cudnn_graphs.clear_cache()
    try:
        for spec, text in (
            (_backward(packed=True, dim_qk=256, dim_v=128, seq_q=256, seq_kv=256), "packed-d256-other-dv-backward"),
            (_backward(batch=1, heads_q=1, heads_kv=1, seq_q=1, seq_kv=128), "bwd-plan-segfault-b1-h1-s1"),
            (_backward(batch=65536, seq_q=16, seq_kv=16), "batch-or-heads-over-65535"),
            (_backward(batch=65536, seq_q=16, seq_kv=16)._replace(direction="forward"), "batch-or-heads-over-65535"),
            (_backward(batch=1, heads_q=65536, heads_kv=1, seq_q=16, seq_kv=16), "batch-or-heads-over-65535"),
            (_backward(packed=True, batch=70000, seq_q=64, seq_kv=64), "batch-or-heads-over-65535"),
        ):
            with pytest.raises(GraphRejected, match=text):
                cudnn_graphs.get_graph(spec)
            with pytest.raises(GraphRejected, match=text):  # the verdict is kept
                cudnn_graphs.get_graph(spec)
        assert not built
    finally:
        cudnn_graphs.clear_cache()


def test_every_entry_says_what_where_and_what_is_done():
    for erratum in errata.ERRATA:
        assert erratum.action in (errata.REROUTE, errata.REFUSE, errata.UNMET)
        assert (erratum.affects is None) == (erratum.action == errata.UNMET), erratum.key
        assert erratum.what and erratum.seen_on and erratum.report and erratum.workaround and erratum.test
    assert len({erratum.key for erratum in errata.ERRATA}) == len(errata.ERRATA)


def test_the_doctor_lists_the_loaded_versions_entries_and_what_a_newer_cudnn_fixes():
    on_919 = "\n".join(doctor.known_issues(V919))
    assert "dq-nan-kv-64-mod-128" in on_919 and "float32-output-forward" in on_919 and "dkdv-nan-single-query" in on_919
    on_926 = "\n".join(doctor.known_issues(V926))
    assert "dq-nan-kv-64-mod-128" not in on_926 and "dkdv-nan-single-query" in on_926 and "bwd-plan-segfault" in on_926
    assert len(doctor.known_issues(None)) == len(errata.ERRATA)
    advice = doctor.newer_cudnn_advice(V919, "13.0")
    assert any("dq-nan-kv-64-mod-128" in line and "9.26.0" in line for line in advice)
    # The newest fix among them: 9.28.1 (backward-past-2**31-elements), which also measured fastest.
    assert "fixed in cuDNN 9.28.1 (measured clean here; worked around here): backward-past-2**31-elements" in advice
    assert "fixed in cuDNN 9.26.0 (upstream; worked around here): dq-nan-kv-64-mod-128" in advice
    assert any("pip install -U 'nvidia-cudnn-cu13>=9.28.1'" in line for line in advice)
    # What pip did over torch 2.15.0+cu132's pin (9.26.0.51), measured: an ERROR line, exit status 0, and a later
    # `pip install accelerate` would put 9.26.0.51 back.
    assert any("which is incompatible" in line and "puts the pinned version back" in line for line in advice)
    (speed,) = [line for line in advice if line.startswith("speed on an H200")]
    assert "9.27.0: fwd+bwd 0.80-1.02x" in speed and "9.28.1: fwd+bwd 1.04-1.07x" in speed
    assert speed.endswith("later versions not measured here")
    assert any("pip install -U 'nvidia-cudnn-cu12>=9.28.1'" in line for line in doctor.newer_cudnn_advice(V926, "12.8"))
    assert doctor.newer_cudnn_advice(92801, "12.8") == [] and doctor.newer_cudnn_advice(None, None) == []


def test_the_grid_limit_refuses_only_past_65535_and_packed_bounds_stay_within_it():
    # torch's own cuDNN path saw B 65,535 run and 65,536 fail (pytorch#181085): the limit itself is served.
    for spec in (_backward(batch=65535, seq_q=16, seq_kv=16), _backward(batch=1, heads_q=65535, heads_kv=5, seq_q=16, seq_kv=16)):
        assert _key(spec, V919) is None and _key(spec, V926) is None, spec
    from cudnn_attention.layouts import packed_bounds

    # 40,000 documents: a power-of-two bound would be 65,536 (refused); the cap keeps them on cuDNN.
    assert packed_bounds(documents=40000, max_seqlen=8, tokens=320000)[0] == errata.GRID_LIMIT
    assert packed_bounds(documents=70000, max_seqlen=8, tokens=560000)[0] == 70000  # past it: refused, as its graph says
    assert packed_bounds(documents=1000, max_seqlen=8, tokens=8000)[0] == 1024
