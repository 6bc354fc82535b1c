"""The cuDNN path's LSE gradient, checked without a GPU.

cuDNN's backward graph takes no dLSE; ``launch.run_backward`` gets the LSE's share of dQ and dK from one more
launch of the same graph on stand-in operands (``_lse_gradient_operands``: V' = 0, and O', dO' whose row dot
product is -dLSE). Here (1) that identity is checked in float64 with plain torch formulas, (2) the stand-in
operands are checked to carry dLSE to about 16 bits in bfloat16 and 22 in float16 over a wide range, and (3) the
package's launch code runs end to end on CPU with the graphs emulated (``tests/support/emulated_cudnn.py``): the eager bypass
(``_EagerAttention``) and the ops (their schema, fake kernels and autograd formula, ``torch.library.opcheck``),
against float64 autograd of the independent reference. ``tests/gpu/test_gpu_lse_grad.py`` runs the real graphs.
"""

import itertools

import pytest
import torch

import cudnn_attention
from cudnn_attention import cudnn_ops, graph_spec, launch
from cudnn_attention import plan as plans
from cudnn_attention.lse_gradient import lse_gradient_operands, lse_sink_gradient, masked_lse_gradient
from support.emulated_cudnn import emulated
from support.reference64 import dense_visibility, evaluate_call, reference_attention

# ----------------------------------------------------------------------------------------------
# (1) The identity, in float64 with plain torch formulas
# ----------------------------------------------------------------------------------------------


def _attention_backward(probs, q, k, v, out, grad_out, scale):
    """FlashAttention's backward from the probabilities, (B, H, S, D) tensors, one KV head per query head."""
    d_scores = probs * (grad_out @ v.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
    return scale * d_scores @ k, scale * d_scores.transpose(-1, -2) @ q, probs.transpose(-1, -2) @ grad_out


@pytest.mark.parametrize("sinks", [False, True])
def test_extra_backward_gives_the_lse_gradient_float64(sinks):
    """dQ' and dK' of the backward fed (V' = 0, O', dO') are exactly the gradient of sum(lse * dlse), and
    ``_lse_sink_gradient`` is dSink's share; rows with lse = -inf (padding, a row that sees no key) take none of
    the random gradient handed to them."""
    torch.manual_seed(0)
    B, H, S_q, S_kv, D, D_v, scale = 2, 3, 9, 6, 5, 4, 0.4
    q = torch.randn(B, H, S_q, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, H, S_kv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, H, S_kv, D_v, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(H, dtype=torch.float64, requires_grad=True) if sinks else None
    options = dict(scale=scale, causal=True, bottom_right=True, seqlens_q=torch.tensor([9, 5]), seqlens_kv=torch.tensor([6, 6]))
    out, lse = reference_attention(q, k, v, sinks=sink, return_lse=True, **options)
    dead = lse == float("-inf")
    assert dead[0, :, :3].all() == (not sinks) and dead[1, :, 5:].all()  # rows that see no key; padding
    grad_lse = torch.randn(lse.shape, dtype=torch.float32).double()  # dLSE arrives in the LSE's float32
    inputs = [t for t in (q, k, sink) if t is not None]
    want = torch.autograd.grad(lse, inputs, grad_lse, retain_graph=True)

    # The probabilities as the graph recomputes them: from the (sink-inclusive) LSE, zero where a key is hidden.
    visible_BQK, _ = dense_visibility(B, S_q, S_kv, options["seqlens_q"], options["seqlens_kv"], causal=True, bottom_right=True)
    scores = scale * q.detach() @ k.detach().transpose(-1, -2)
    probs = torch.where(visible_BQK.unsqueeze(1), torch.exp(scores - lse.detach().unsqueeze(-1)), 0.0)
    dlse = masked_lse_gradient(grad_lse, lse.detach())
    v_zero, o_unit, do_lse = lse_gradient_operands(dlse, out.detach(), v.detach())
    assert v_zero.stride() == v.stride() and o_unit.stride() == do_lse.stride() == out.stride() and not v_zero.any()
    dq, dk, _ = _attention_backward(probs, q.detach(), k.detach(), v_zero, o_unit, do_lse, scale)  # dV' is no gradient
    torch.testing.assert_close(dq, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dk, want[1], rtol=1e-12, atol=1e-12)
    assert dq.abs().max() > 0.1, "a zero gradient would pass a comparison with a zero reference"
    if sinks:
        torch.testing.assert_close(lse_sink_gradient(dlse, lse.detach(), sink.detach()), want[2], rtol=1e-12, atol=1e-12)
    # Added to the ordinary backward's, the whole gradient of a loss that uses both outputs.
    grad_out = torch.randn_like(out)
    full = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    main = _attention_backward(probs, q.detach(), k.detach(), v.detach(), out.detach(), grad_out, scale)
    for got, expected in zip((main[0] + dq, main[1] + dk, main[2]), full):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# (2) The stand-in operands carry dLSE in 16-bit dtypes
# ----------------------------------------------------------------------------------------------


# (dtype, dLSE magnitudes, significant bits D' keeps). bfloat16 has float32's range: about 17 bits everywhere.
# float16's products of two normal values reach down to 2**-28: 23 bits from 1e-5 (hi and lo both normal), 12 bits
# down to 4e-9 (lo subnormal), as a float16 output gradient would fare there (float16 training scales its loss).
CARRIED = [
    (torch.bfloat16, (1e-12, 1e10), 16),
    (torch.float16, (1e-5, 1e9), 22),
    (torch.float16, (4e-9, 1e-5), 11),
    (torch.float32, (1e-30, 1e30), 23),
]


@pytest.mark.parametrize("dtype, magnitudes, bits", CARRIED)
@pytest.mark.parametrize("D_v", [2, 64])
def test_lse_operands_carry_dlse_across_magnitudes(dtype, magnitudes, bits, D_v):
    # Both signs and zeros; cuDNN reads D' = rowsum(dO' * O') in float32 from 16-bit values (their products are
    # exact in float32). Without the hi/lo split and the per-row power of two: 8 bits (bfloat16), 11 (float16).
    low, high = magnitudes
    m = torch.logspace(torch.log10(torch.tensor(low)).item(), torch.log10(torch.tensor(high)).item(), 97)
    dlse = torch.cat([m, -m, torch.zeros(3)]).view(1, 197)  # a packed (T, H) LSE's gradient
    out = torch.empty(1, 197, D_v, dtype=dtype)
    v = torch.empty(5, 197, D_v, dtype=dtype)
    v_zero, o_unit, do_lse = lse_gradient_operands(dlse, out, v)
    assert all(t.dtype == dtype for t in (v_zero, o_unit, do_lse)) and not v_zero.any()
    assert o_unit[..., 2:].count_nonzero() == 0 and do_lse[..., 2:].count_nonzero() == 0, "columns past the first two stay zero"
    row_dot = (do_lse.float() * o_unit.float()).sum(-1)  # what cuDNN computes, in float32
    relative = (row_dot.double() + dlse.double()).abs() / dlse.double().abs()
    assert relative[dlse != 0].max() <= 2.0**-bits, relative[dlse != 0].max()
    assert (row_dot[dlse == 0] == 0).all()


def test_lse_operands_with_one_value_column_round_once():
    dlse = torch.tensor([[1 / 3, -1e-7, 5e3]])
    _, o_unit, do_lse = lse_gradient_operands(dlse, torch.empty(1, 3, 1, dtype=torch.bfloat16), torch.empty(2, 3, 1, dtype=torch.bfloat16))
    row_dot = (do_lse.float() * o_unit.float()).sum(-1)
    torch.testing.assert_close(row_dot, -dlse, rtol=2**-8, atol=0)


def test_lse_operands_keep_any_operand_strides():
    # V sliced out of a fused projection (gaps) and an expanded V (stride 0): V' has v's strides, all zero.
    fused = torch.randn(2, 7, 3, 4, 8, dtype=torch.bfloat16)
    out = torch.empty(2, 7, 4, 8, dtype=torch.bfloat16).transpose(1, 2)
    for v in (fused[:, :, 2].transpose(1, 2), torch.randn(1, 1, 7, 8, dtype=torch.bfloat16).expand(2, 4, 7, 8)):
        v_zero, o_unit, do_lse = lse_gradient_operands(torch.randn(2, 4, 7), out, v)
        assert v_zero.stride() == v.stride() and v_zero.shape == v.shape and not v_zero.any()
        assert o_unit.stride() == do_lse.stride() == out.stride()


def test_masked_lse_gradient_zeroes_rows_without_a_softmax():
    lse = torch.tensor([[0.5, float("-inf")], [float("-inf"), -3.0]])
    grad = torch.tensor([[2.0, float("nan")], [7.0, 1.0]]).expand(2, 2)
    assert torch.equal(masked_lse_gradient(grad, lse), torch.tensor([[2.0, 0.0], [0.0, 1.0]]))


# ----------------------------------------------------------------------------------------------
# (3) The launch code end to end, graphs emulated
# ----------------------------------------------------------------------------------------------

# name -> (api, case): dense (B=2, H=4, H_kv, S_q, S_kv, D=8) or packed documents; every case but the first has -inf LSE rows.
DENSE_SINK_OPTIONS = dict(causal=True, bottom_right=True)
WINDOW_OPTIONS = dict(causal=True, window_size=(2, 0))
CASES = {
    "dense_plain_gqa": ("dense", dict(h_kv=1, options=dict(causal=True))),
    "dense_padded_no_key_sequence": ("dense", dict(options=dict(causal=True, bottom_right=True), seqlens=([7, 4], [7, 0]))),
    "dense_sinks_engine_padded": ("dense", dict(sinks=True, options=dict(causal=True, window_size=(2, 0)), seqlens=([7, 5], [7, 6]))),
    "dense_sinks_fold_rows_without_keys": ("dense", dict(sinks=True, fold=True, s_q=9, s_kv=5, options=DENSE_SINK_OPTIONS)),
    # cuDNN >= 9.28.1: the dense backward graph holds the sinks and writes dSink (graph_spec.dsink_in_graph).
    "dense_sinks_engine_dsink_in_graph": ("dense", dict(sinks=True, version=92801, options=dict(causal=True, window_size=(2, 0)))),
    "dense_sinks_fold_rows_without_keys_dsink_in_graph": (
        "dense",
        dict(sinks=True, fold=True, version=92801, h_kv=1, s_q=9, s_kv=5, options=DENSE_SINK_OPTIONS),
    ),
    "packed_tail": ("varlen", dict(lengths=[5, 1, 7], tail=3, options=dict(causal=True))),
    "packed_sinks_fold_empty_document_tail": ("varlen", dict(lengths=[4, 0, 6], tail=2, sinks=True, fold=True, options=WINDOW_OPTIONS)),
    "packed_sinks_engine_queries_without_keys": (
        "varlen",
        dict(lengths=[4, 6], kv_lengths=[4, 0], tail=2, sinks=True, engine=True, options=dict(causal=True, window_size=(3, 0))),
    ),
}
LOSSES = ("out", "out+lse", "lse")
SCALE = 0.35


def _case(name, monkeypatch, dtype=torch.float64, seed=0):
    """``(api, args, kwargs)``; sets the sink forward the case asks for (the engine or the fold, else the default)."""
    api_name, case = CASES[name]
    if case.get("fold") or case.get("engine"):
        monkeypatch.setattr(plans, "sink_forward", lambda: "fold" if case.get("fold") else "engine")
    monkeypatch.setattr(graph_spec, "cudnn_version", lambda: case.get("version"))
    torch.manual_seed(seed)
    H, H_kv, D = 4, case.get("h_kv", 2), 8
    sinks = torch.randn(H, requires_grad=True) if case.get("sinks") else None
    kwargs = dict(case["options"], scale=SCALE, sinks=sinks, return_lse=True)
    if api_name == "dense":
        B, S_q, S_kv = 2, case.get("s_q", 7), case.get("s_kv", 7)
        q = torch.randn(B, H, S_q, D, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(B, H_kv, S_kv, D, dtype=dtype, requires_grad=True) for _ in range(2))
        if "seqlens" in case:
            kwargs.update(seqlens_q=torch.tensor(case["seqlens"][0]), seqlens_kv=torch.tensor(case["seqlens"][1]))
        return api_name, (q, k, v), kwargs
    q_lengths, kv_lengths, tail = case["lengths"], case.get("kv_lengths", case["lengths"]), case["tail"]
    cu_q = torch.tensor([0, *itertools.accumulate(q_lengths)], dtype=torch.int32)
    cu_kv = torch.tensor([0, *itertools.accumulate(kv_lengths)], dtype=torch.int32)
    q = torch.randn(sum(q_lengths) + tail, H, D, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(kv_lengths) + tail, H_kv, D, dtype=dtype, requires_grad=True) for _ in range(2))
    return api_name, (q, k, v, cu_q, cu_kv, max(q_lengths), max(kv_lengths)), kwargs


def _assert_ok(result):
    assert result["ok"], [c for c in result["checks"] if not c["ok"]]


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name", CASES)
def test_emulated_cudnn_lse_gradients_match_float64(name, loss, path, monkeypatch):
    api_name, args, kwargs = _case(name, monkeypatch)
    eager_nodes = []
    real_eager = cudnn_ops._eager_attention
    monkeypatch.setattr(cudnn_ops, "_eager_attention", lambda *a: eager_nodes.append(1) or real_eager(*a))
    with emulated(monkeypatch, op=path == "op") as launches:
        _assert_ok(evaluate_call(api_name, args, kwargs, loss=loss))
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] == 1 and stats["cudnn_backward"] == 1 and not stats["fallback_forward"]
    assert eager_nodes == ([1] if path == "eager" else [])
    # One launch of the backward graph per output the loss uses: a loss without the LSE costs nothing more, and
    # one with the LSE alone skips the output's launch.
    assert (launches["forward"], launches["backward"]) == (1, {"out": 1, "out+lse": 2, "lse": 1}[loss])


@pytest.mark.parametrize(
    ("name", "version", "in_graph"),
    [
        ("dense_sinks_engine_dsink_in_graph", 92801, True),
        ("dense_sinks_engine_dsink_in_graph", 92800, False),
        ("dense_sinks_fold_rows_without_keys_dsink_in_graph", 92801, True),
        ("dense_sinks_engine_padded", 92801, False),  # padded: not measured, the pass stays
        ("packed_sinks_fold_empty_document_tail", 92801, False),  # packed: slower in the graph on 9.28.1
    ],
)
@pytest.mark.parametrize("path", ["eager", "op"])
def test_dsink_comes_from_the_backward_graph_only_where_the_version_and_call_allow(name, version, in_graph, path, monkeypatch):
    api_name, args, kwargs = _case(name, monkeypatch)
    monkeypatch.setattr(graph_spec, "cudnn_version", lambda: version)
    passes = []
    real_pass = launch.sink_gradient
    monkeypatch.setattr(launch, "sink_gradient", lambda *a: passes.append(1) or real_pass(*a))
    held = []
    with emulated(monkeypatch, op=path == "op"):
        real_execute = launch.execute
        monkeypatch.setattr(launch, "execute", lambda graph, *a: held.append(graph.has_sinks) or real_execute(graph, *a))
        _assert_ok(evaluate_call(api_name, args, kwargs, loss="out+lse"))
    assert held[1:] == [in_graph, in_graph]  # the forward, then the output's and the LSE's backward launches
    assert passes == ([] if in_graph else [1])


SIXTEEN_BIT_CASES = ["dense_sinks_engine_padded", "packed_sinks_fold_empty_document_tail", "dense_sinks_engine_dsink_in_graph"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", SIXTEEN_BIT_CASES)
def test_emulated_cudnn_lse_gradients_in_16_bits(name, dtype, monkeypatch):
    # The operands in the dtype cuDNN runs (the hi/lo split, dQ' and dK' rounded and added): FlashAttention's rule.
    api_name, args, kwargs = _case(name, monkeypatch, dtype=dtype)
    with emulated(monkeypatch):
        _assert_ok(evaluate_call(api_name, args, kwargs, loss="out+lse"))


def test_emulated_op_passes_opcheck(monkeypatch):
    # Schema, fake kernels against the real ones, the autograd registration, and AOT autograd's backward against
    # eager's (random gradients of both outputs, -inf LSE rows included).
    _, (q, k, v, cu_q, cu_kv, max_q, max_kv), kwargs = _case("packed_sinks_engine_queries_without_keys", monkeypatch)
    # The case's options (causal, window (3, 0)) as the op spells them: window_left 3, window_right 0.
    options = dict(
        sinks=kwargs["sinks"],
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        scale=SCALE,
        window_left=3,
        window_right=0,
        need_lse=True,
    )
    with emulated(monkeypatch, op=True) as launches:
        torch.library.opcheck(torch.ops.cudnn_attention.forward.default, (q, k, v), options)
    assert launches["backward"] >= 2, "opcheck ran the backward, with the LSE's gradient"


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("name", ["dense_padded_no_key_sequence", "packed_sinks_fold_empty_document_tail"])
def test_emulated_nan_gradient_on_rows_without_a_softmax_stops_there(name, path, monkeypatch):
    # A loss may hand -inf rows any gradient, NaN included (an LSE normalized by its own max, say): those rows have
    # no softmax, so it must reach no input; the other rows' gradients are those of a zero there.
    api_name, args, kwargs = _case(name, monkeypatch)
    fn = cudnn_attention.attention if api_name == "dense" else cudnn_attention.varlen_attention
    inputs = [t for t in (*args[:3], kwargs["sinks"]) if t is not None]
    with emulated(monkeypatch, op=path == "op"):
        _, lse = fn(*args, **kwargs)
        dead = lse == float("-inf")
        assert dead.any() and not dead.all()
        grad_lse = torch.randn_like(lse).masked_fill(dead, 0.0)
        want = torch.autograd.grad(lse, inputs, grad_lse, retain_graph=True, allow_unused=True)
        got = torch.autograd.grad(lse, inputs, grad_lse.masked_fill(dead, float("nan")), allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.any()
        else:
            assert torch.isfinite(g).all() and torch.equal(g, w)


@pytest.mark.parametrize("loss", ["out+lse", "lse"])
def test_emulated_op_under_torch_compile(loss, monkeypatch):
    # AOT autograd traces the op's backward formula with the LSE's gradient (and, for a loss over the LSE alone, the
    # output's as None or zeros) through the fake kernels; aot_eager runs the traced graphs on the CPU kernels.
    _, (q, k, v), kwargs = _case("dense_sinks_engine_padded", monkeypatch)
    sinks = kwargs.pop("sinks")
    torch.manual_seed(1)
    w_out, w_lse = torch.randn(q.shape, dtype=q.dtype), torch.randn(q.shape[:-1], dtype=torch.float64)

    def loss_fn(attend, q, k, v, sinks):
        out, lse = attend(q, k, v, sinks=sinks, **kwargs)
        lse_term = (torch.where(lse == float("-inf"), 0.0, lse) * w_lse).sum()  # the -inf rows' gradient is zero either way
        return lse_term if loss == "lse" else (out * w_out).sum() + lse_term

    inputs = (q, k, v, sinks)
    want = torch.autograd.grad(loss_fn(reference_attention, *inputs), inputs, allow_unused=True)  # float64 autograd
    with emulated(monkeypatch, op=True) as launches:
        compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
        got = torch.autograd.grad(compiled(cudnn_attention.attention, *inputs), inputs, allow_unused=True)
    assert launches["backward"] >= 1 and cudnn_attention.stats()["cudnn_backward"] >= 1
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        if w is None:  # dV of a loss over the LSE alone: zero, or no gradient at all
            assert g is None or not g.any(), name
        else:
            torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
