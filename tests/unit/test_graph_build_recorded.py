"""The graph builder (``graph_build._construct``) on CPU, against a stand-in of the cuDNN frontend that records what it is
asked: the nodes' mask arguments (the mask's own cuDNN diagonal), the padding mask and lengths of a padded graph (the
errata's reroute among them), the sinks and LSE operands, the implementation family, and the operand uids a launch
passes in that order. The real frontend needs a GPU; this keeps the builder's own code under test everywhere."""

import contextlib
import types

import pytest
import torch

from cudnn_attention import graph_build
from cudnn_attention.masking import MaskSpec
from support.graph_specs import graph_spec


class _Tensor:
    def __init__(self, graph, **attributes):
        self.graph, self.attributes = graph, attributes

    def set_ragged_offset(self, column):
        self.attributes["ragged"] = column
        return self

    def set_uid(self, uid):
        self.attributes["uid"] = uid
        return self

    def set_output(self, value):
        return self

    def set_dim(self, dims):
        self.attributes["dim"] = dims
        return self

    def set_stride(self, strides):
        return self

    def set_data_type(self, data_type):
        return self


class _Graph:
    def __init__(self, **settings):
        self.settings, self.nodes, self.selected_engine = settings, [], "recorded"

    def tensor(self, **attributes):
        return _Tensor(self, **attributes)

    def sdpa(self, **kwargs):
        self.nodes.append(("sdpa", kwargs))
        return _Tensor(self, name="o"), _Tensor(self, name="stats")

    def sdpa_backward(self, **kwargs):
        self.nodes.append(("sdpa_backward", kwargs))
        return _Tensor(self, name="dq"), _Tensor(self, name="dk"), _Tensor(self, name="dv")

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        self.modes = modes

    def get_workspace_size(self):
        return 0


def _frontend():
    names = types.SimpleNamespace
    return names(
        data_type=names(HALF="HALF", BFLOAT16="BFLOAT16", FLOAT="FLOAT", INT32="INT32", INT64="INT64"),
        diagonal_alignment=names(TOP_LEFT="TOP_LEFT", BOTTOM_RIGHT="BOTTOM_RIGHT"),
        attention_implementation=names(AUTO="AUTO", COMPOSITE="COMPOSITE", UNIFIED="UNIFIED"),
        heur_mode=names(A="A", B="B", FALLBACK="FALLBACK"),
        build_plan_policy=names(ALL="ALL"),
        pygraph=_Graph,
    )


@pytest.fixture
def build(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())

    def construct(**changes):
        spec = graph_spec(**changes)
        compiled = graph_build._construct(_frontend(), spec, handle=None)
        ((kind, kwargs),) = compiled.graph.nodes
        return compiled, kind, kwargs

    return construct


def test_a_dense_window_forward_with_sinks_and_the_lse(build):
    compiled, kind, kwargs = build(mask=MaskSpec(63, 0, True), sinks=True, need_lse=True, seq_q=32)
    assert kind == "sdpa" and kwargs["diagonal_band_left_bound"] == 64 and kwargs["diagonal_band_right_bound"] == 0
    assert kwargs["diagonal_alignment"] == "BOTTOM_RIGHT" and not kwargs["use_padding_mask"] and kwargs["seq_len_q"] is None
    assert kwargs["generate_stats"] and kwargs["sink_token"] is not None and "implementation" not in kwargs
    assert compiled.uids == (1, 2, 3, 100, 101, 4) and compiled.full_lengths is None and compiled.mask == MaskSpec(63, 0, True)
    assert compiled.graph.settings["io_data_type"] == "BFLOAT16"


def test_a_rerouted_backward_is_the_padded_graph_with_its_lengths_last(build):
    # What an erratum's reroute builds for an unpadded call: a padding mask, and the two length operands after the grads.
    compiled, kind, kwargs = build(direction="backward", mask=MaskSpec(), padded=True, seq_q=576, seq_kv=576, grad_strides=((1,) * 4,) * 3)
    assert kind == "sdpa_backward" and kwargs["use_padding_mask"] and kwargs["seq_len_q"] is not None
    assert kwargs["diagonal_band_left_bound"] is None and kwargs["diagonal_alignment"] == "TOP_LEFT"
    assert compiled.uids == (1, 2, 3, 100, 200, 101, 201, 202, 203, 5, 6)
    assert compiled.full_lengths == (1, 576, 576)


def test_a_backward_holding_the_sinks_writes_dsink_after_dv(build):
    # A dense call's on cuDNN >= 9.28.1 (graph_spec.dsink_in_graph); elsewhere what benchmarks/sink_backward.py builds to measure it.
    compiled, kind, kwargs = build(direction="backward", mask=MaskSpec(-1, 0), sinks=True, grad_strides=((1,) * 4,) * 3)
    assert kind == "sdpa_backward" and kwargs["sink_token"].attributes["uid"] == 4
    dsinks = kwargs["dSink_token"].attributes
    assert dsinks["uid"] == 204 and dsinks["dim"] == [1, 2, 1, 1] and dsinks["data_type"] == "FLOAT"
    assert compiled.uids == (1, 2, 3, 100, 200, 101, 201, 202, 203, 4, 204)
    _, _, without = build(direction="backward", mask=MaskSpec(-1, 0), grad_strides=((1,) * 4,) * 3)
    assert "sink_token" not in without and "dSink_token" not in without


def test_a_packed_forward_shares_ragged_columns_and_an_implementation_family(build):
    strides = (64 * 2 * 64, 64, 2 * 64, 1)
    compiled, _, kwargs = build(
        packed=True,
        need_lse=True,
        implementation="unified",
        q_strides=strides,
        k_strides=strides,
        v_strides=strides,
        o_strides=strides,
        dtype=torch.float16,
    )
    assert kwargs["implementation"] == "UNIFIED" and kwargs["use_padding_mask"]
    # One offset column per (side, token stride): q and O share one, k and v another, the LSE (token stride H) its own.
    assert compiled.ragged_columns == (("q", 128), ("kv", 128), ("q", 2))
    assert compiled.uids[-5:] == (5, 6, 300, 301, 302) and compiled.full_lengths is None
    assert compiled.graph.settings["io_data_type"] == "HALF"


def test_a_mask_cuDNN_cannot_express_fails_the_build(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())

    class Chunked(MaskSpec):  # a mask kind without a cuDNN diagonal: the cache turns the error into a rejection
        def cudnn_diagonal(self, cudnn):
            raise NotImplementedError("no such mask in cuDNN")

    with pytest.raises(NotImplementedError):
        graph_build._construct(_frontend(), graph_spec(mask=Chunked()), handle=None)
