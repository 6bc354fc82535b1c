"""The LSE's gradient on cuDNN: one more launch of the backward graph (``launch.run_backward``), on a GPU.

Gradients of losses over the output and the LSE (random weights on every row, ``-inf`` rows included), or over
the LSE alone, against float64 autograd of the independent reference, by FlashAttention's rule
(``reference64.evaluate_call``: twice the error of the same math in the input dtype, plus 1e-3 of the largest
magnitude). Strict mode and the counters prove cuDNN served forward and backward. CPU twins, with the graphs
emulated: ``tests/unit/test_lse_grad_emulated.py``.
"""

import itertools

import pytest
import torch

import cudnn_attention
from cudnn_attention import cudnn_ops, launch
from cudnn_attention import plan as plans
from support.reference64 import compare_tensors, evaluate_call, reference_attention
from support.sync_debug import warm_and_run

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
LOSSES = ("out+lse", "lse")

DENSE = {
    "causal": dict(options=dict(causal=True)),
    "causal_gqa_sinks": dict(group=4, sinks=True, options=dict(causal=True)),
    "window_sinks": dict(sinks=True, options=dict(causal=True, window_size=(37, 0))),
    "left_right_window": dict(options=dict(window_size=(29, 13))),
    "padded_sinks_bottom_right": dict(group=4, sinks=True, seqlens=([203, 150], [203, 170]), options=dict(causal=True, bottom_right=True)),
    "padded_no_key_sequence": dict(seqlens=([203, 90], [150, 0]), options=dict(causal=True, window_size=(50, 0))),
    # 67 queries over 203 keys: the decode shape; the sink engine declines s_q = 1, not this.
    "decode_bottom_right_sinks": dict(s_q=67, sinks=True, options=dict(causal=True, bottom_right=True)),
}
PACKED = {
    "causal": dict(options=dict(causal=True)),
    "window_sinks": dict(sinks=True, options=dict(causal=True, window_size=(40, 0))),
    "sinks_empty_documents_tail": dict(lengths=[50, 0, 31, 0], tail=7, sinks=True, options=dict(causal=True)),
    "queries_without_keys_window": dict(kv_lengths=[129, 0, 77, 300, 5], tail=3, options=dict(causal=True, window_size=(32, 0))),
}
ODD_LENGTHS = [129, 1, 77, 300, 5]


def _dense_args(case, dtype, head_dim=64, seed=0):
    torch.manual_seed(seed)
    H, S_kv = 8, 203
    S_q = case.get("s_q", S_kv)
    H_kv = H // case.get("group", 1)
    q = torch.randn(2, S_q, H, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_()  # transformers' layout
    k = torch.randn(2, H_kv, S_kv, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(2, H_kv, S_kv, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    kwargs = dict(case["options"], return_lse=True)
    if case.get("sinks"):
        kwargs["sinks"] = torch.randn(H, device=DEVICE, dtype=dtype, requires_grad=True)
    if "seqlens" in case:
        kwargs["seqlens_q"], kwargs["seqlens_kv"] = (torch.tensor(n, device=DEVICE, dtype=torch.int32) for n in case["seqlens"])
    return (q, k, v), kwargs


def _packed_args(case, dtype, head_dim=64, seed=0):
    torch.manual_seed(seed)
    H, H_kv = 8, 2
    q_lengths = case.get("lengths", ODD_LENGTHS)
    kv_lengths = case.get("kv_lengths", q_lengths)
    tail = case.get("tail", 0)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lengths)], device=DEVICE, dtype=torch.int32)
    cu_kv = torch.tensor([0, *itertools.accumulate(kv_lengths)], device=DEVICE, dtype=torch.int32)
    q = torch.randn(sum(q_lengths) + tail, H, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(kv_lengths) + tail, H_kv, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(kv_lengths) + tail, H_kv, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    kwargs = dict(case["options"], return_lse=True)
    if case.get("sinks"):
        kwargs["sinks"] = torch.randn(H, device=DEVICE, dtype=torch.float32, requires_grad=True)
    return (q, k, v, cu_q, cu_kv, max(q_lengths), max(kv_lengths)), kwargs


def _served_and_ok(api, args, kwargs, loss):
    """Run ``evaluate_call`` in strict mode (cuDNN must serve both directions) and assert every check."""
    cudnn_attention.reset_stats()
    with cudnn_attention.strict():
        result = evaluate_call(api, args, kwargs, loss=loss)
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] > 0 and stats["cudnn_backward"] > 0, stats
    assert not stats["fallback_forward"] and not stats["fallback_backward"], stats
    assert result["ok"], [c for c in result["checks"] if not c["ok"]]
    return result


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", DENSE)
def test_dense_lse_gradients_match_float64(name, dtype, loss):
    _served_and_ok("dense", *_dense_args(DENSE[name], dtype), loss)


@pytest.mark.parametrize("head_dim", [128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_lse_gradients_head_dim_128(dtype, head_dim):
    _served_and_ok("dense", *_dense_args(DENSE["causal_gqa_sinks"], dtype, head_dim=head_dim), "out+lse")


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", PACKED)
def test_packed_lse_gradients_match_float64(name, dtype, loss):
    _served_and_ok("varlen", *_packed_args(PACKED[name], dtype), loss)


@pytest.mark.parametrize("sink_forward", ["engine", "fold"])
def test_dense_sink_forward_either_way(sink_forward, monkeypatch):
    # The sink engine and the fold hand the backward the same sink-inclusive LSE; the LSE's share reads it.
    monkeypatch.setattr(plans, "sink_forward", lambda: sink_forward)
    _served_and_ok("dense", *_dense_args(DENSE["padded_sinks_bottom_right"], torch.bfloat16), "out+lse")


def _spy_on_launches(monkeypatch):
    launches = {"forward": 0, "backward": 0}
    real = launch.execute

    def spy(graph, operands, device_index):
        launches[graph.spec.direction] += 1
        return real(graph, operands, device_index)

    monkeypatch.setattr(launch, "execute", spy)
    return launches


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("loss, backward_launches", [("out", 1), ("out+lse", 2), ("lse", 1)])
def test_one_more_launch_only_when_the_loss_uses_the_lse(loss, backward_launches, path, monkeypatch):
    """The eager bypass (``_EagerAttention``, plain tensors) and the op (forced here by declaring the call unsafe for
    the bypass: what a tensor subclass or a dispatch mode gets) give the same verdicts; a loss without the LSE
    launches the backward graph once, as before, and one with the LSE alone skips the output's launch."""
    eager_nodes = []
    if path == "op":
        monkeypatch.setattr(cudnn_ops, "_eager_safe", lambda q, k, v: False)
    else:
        real_eager = cudnn_ops._eager_attention
        monkeypatch.setattr(cudnn_ops, "_eager_attention", lambda *a: eager_nodes.append(1) or real_eager(*a))
    launches = _spy_on_launches(monkeypatch)
    args, kwargs = _packed_args(PACKED["window_sinks"], torch.bfloat16)
    if loss == "out":
        kwargs["return_lse"] = False
    _served_and_ok("varlen", args, kwargs, loss)
    assert launches == {"forward": 1, "backward": backward_launches}
    assert eager_nodes == ([1] if path == "eager" else [])


def test_torch_compile_fullgraph_lse_gradients_match_eager():
    # The op path under torch.compile: AOT autograd's backward hands the op the LSE's gradient.
    args, kwargs = _dense_args(DENSE["causal_gqa_sinks"], torch.bfloat16)
    q, k, v = args
    sinks = kwargs.pop("sinks")
    kwargs.pop("return_lse")
    torch.manual_seed(1)
    w_out = torch.randn(q.shape[:-1] + v.shape[-1:], device=DEVICE)
    w_lse = torch.randn(q.shape[:-1], device=DEVICE)

    def loss_fn(q, k, v, sinks):
        out, lse = cudnn_attention.attention(q, k, v, sinks=sinks, return_lse=True, **kwargs)
        return (out.float() * w_out).sum() + (lse * w_lse).sum()

    eager = torch.autograd.grad(loss_fn(q, k, v, sinks), (q, k, v, sinks))
    cudnn_attention.reset_stats()
    compiled = torch.autograd.grad(torch.compile(loss_fn, fullgraph=True)(q, k, v, sinks), (q, k, v, sinks))
    assert cudnn_attention.stats()["cudnn_backward"] >= 1
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=lambda m, name=name: f"{name}: {m}")
    assert eager[0].abs().max() > 0


def test_opcheck_with_the_lse_gradient():
    # Schema, fake kernels, autograd registration, and AOT autograd's backward (random gradients of both outputs,
    # -inf LSE rows included: a document without keys and a capacity tail) against eager's.
    (q, k, v, cu_q, cu_kv, mq, mk), _ = _packed_args(PACKED["queries_without_keys_window"], torch.bfloat16)
    sinks = torch.randn(q.shape[1], device=DEVICE, requires_grad=True)
    options = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=mq, max_seqlen_kv=mk, scale=0.125, window_left=32, window_right=0)
    torch.library.opcheck(
        torch.ops.cudnn_attention.forward.default, (q, k, v, sinks), dict(options, need_lse=True)
    )  # causal, window (32, 0)


@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_nan_gradient_on_rows_without_a_softmax_stops_there(api):
    # -inf rows (padding, a sequence or document without keys, a capacity tail) may be handed any gradient, NaN
    # included: it must reach no input, and the other rows' gradients are those of a zero there.
    if api == "dense":
        args, kwargs = _dense_args(DENSE["padded_no_key_sequence"], torch.bfloat16)
    else:
        args, kwargs = _packed_args(PACKED["sinks_empty_documents_tail"], torch.bfloat16)
    fn = cudnn_attention.attention if api == "dense" else cudnn_attention.varlen_attention
    inputs = [t for t in (*args[:3], kwargs.get("sinks")) if t is not None]
    torch.use_deterministic_algorithms(True)  # the two backward passes are compared bit for bit
    try:
        with cudnn_attention.strict():
            _, lse = fn(*args, **kwargs)
            dead = lse == float("-inf")
            assert dead.any() and not dead.all()
            grad_lse = torch.randn_like(lse).masked_fill(dead, 0.0)
            want = torch.autograd.grad(lse, inputs, grad_lse, retain_graph=True)
            got = torch.autograd.grad(lse, inputs, grad_lse.masked_fill(dead, float("nan")))
    finally:
        torch.use_deterministic_algorithms(False)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and torch.equal(g, w)


def test_lse_gradient_does_not_synchronize():
    (q, k, v), dense_kwargs = _dense_args(DENSE["padded_sinks_bottom_right"], torch.bfloat16)
    packed_args, packed_kwargs = _packed_args(PACKED["sinks_empty_documents_tail"], torch.bfloat16)

    def dense_step():
        out, lse = cudnn_attention.attention(q, k, v, **dense_kwargs)
        torch.autograd.backward((out, lse), (torch.ones_like(out), torch.ones_like(lse)))

    def packed_lse_only_step():
        _, lse = cudnn_attention.varlen_attention(*packed_args, **packed_kwargs)
        lse.sum().backward()  # an expanded (stride 0) gradient, -inf rows included

    warm_and_run(dense_step)
    warm_and_run(packed_lse_only_step)
    assert cudnn_attention.stats()["cudnn_backward"] == 4


def test_deterministic_lse_gradients_are_bit_identical():
    args, kwargs = _packed_args(PACKED["window_sinks"], torch.bfloat16)
    q, k, v = args[:3]
    sinks = kwargs["sinks"]
    torch.manual_seed(2)
    w_out, w_lse = torch.randn(q.shape[:2] + v.shape[-1:], device=DEVICE, dtype=q.dtype), torch.randn(q.shape[:2], device=DEVICE)
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out, lse = cudnn_attention.varlen_attention(*args, **kwargs)
            runs.append(torch.autograd.grad((out, lse), (q, k, v, sinks), (w_out, w_lse)))
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), *runs):
        assert torch.equal(a, b), f"{name} differs between two deterministic backward passes"


@pytest.mark.parametrize("dtype", DTYPES)
def test_torchtitan_sinks_over_a_sinkless_call(dtype):
    """gpt-oss sinks as torchtitan trains them: ``out * sigmoid(lse - sink)`` over a sink-less cuDNN call. Gradients
    against float64 autograd of the same formula over the reference, bounded by the same formula over the reference
    in ``dtype`` (FlashAttention's rule, ``compare_tensors``)."""
    (q, k, v), kwargs = _dense_args(DENSE["causal"], dtype)
    sinks = torch.randn(q.shape[1], device=DEVICE, requires_grad=True)
    grad = torch.randn(q.shape, device=DEVICE)

    def titan(out, lse, sinks_):
        return out * torch.sigmoid(lse - sinks_.view(1, -1, 1)).unsqueeze(-1)

    with cudnn_attention.strict():
        got = titan(*cudnn_attention.attention(q, k, v, **kwargs), sinks)
        got_grads = torch.autograd.grad(got, (q, k, v, sinks), grad)
    results = {}
    for compute in (torch.float64, dtype):
        leaves = [t.detach().to(compute).requires_grad_() for t in (q, k, v)]
        sink_leaf = sinks.detach().double().requires_grad_() if compute == torch.float64 else sinks.detach().requires_grad_()
        ref = titan(*reference_attention(*leaves, compute_dtype=compute, **kwargs), sink_leaf)
        results[compute] = (ref, torch.autograd.grad(ref, (*leaves, sink_leaf), grad.to(ref.dtype)))
    (ref, ref_grads), (lowp, lowp_grads) = results[torch.float64], results[dtype]
    checks = [compare_tensors("out", got, ref, lowp, floor_rel=1e-3)]
    for name, g, r, lp in zip(("dq", "dk", "dv", "dsinks"), got_grads, ref_grads, lowp_grads):
        checks.append(compare_tensors(name, g, r, lp, floor_rel=1e-3, magnitude=grad.abs().max().item()))
    assert all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    assert cudnn_attention.stats()["cudnn_backward"] >= 1
