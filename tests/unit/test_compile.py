"""torch.compile(fullgraph=True) traces the real exact path on CPU, with no stand-in: outputs and gradients equal the
eager ones, the fallback is counted and warned about per call as in eager, and strict mode refuses compiled calls.

``backend="aot_eager"`` traces as every backend does (Dynamo, then AOTAutograd's joint graph, fullgraph forbids
any break) without Inductor's C++ build, which keeps the suite fast on CI's two cores.
"""

import pytest
import torch

import cudnn_attention

pytest.importorskip("torch._dynamo")

BACKEND = "aot_eager"
# The compiled graph runs the same aten ops on the same float32 values; only the backward's accumulation order may
# differ. A few float32 ulps of each tensor's magnitude.
RTOL32 = 8 * torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_close_rel(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, f"{what}: {actual.dtype}{tuple(actual.shape)}"
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= RTOL32 * scale, f"{what}: max abs error {err:.3g} > {RTOL32:.3g} x max |expected| {scale:.3g}"


DENSE_CASES = {
    "plain": dict(),
    "padded": dict(padded=True, causal=True),
    "sinks": dict(sinks=True, causal=True),
    "window_left_right": dict(window_size=(2, 1)),
    "window_bottom_right": dict(window_size=(2, 0), bottom_right=True, s_q=4),
    "causal_bottom_right_padded_sinks_gqa": dict(causal=True, bottom_right=True, padded=True, sinks=True, h_kv=1, s_q=5),
}

VARLEN_CASES = {
    "packed": dict(),
    "packed_causal": dict(causal=True),
    "packed_sinks": dict(causal=True, sinks=True),
    "packed_window": dict(window_size=(1, 1)),
    "packed_window_bottom_right_decode": dict(window_size=(2, 0), bottom_right=True, decode=True, sinks=True),
}


def _dense(case, seed):
    torch.manual_seed(seed)
    B, H, H_kv, D, S_q, S_kv = 2, 4, case.get("h_kv", 2), 8, case.get("s_q", 7), 7
    leaves = [torch.randn(B, H, S_q, D), torch.randn(B, H_kv, S_kv, D), torch.randn(B, H_kv, S_kv, D)]
    if case.get("sinks"):
        leaves.append(torch.randn(H))
    kwargs = dict(
        scale=0.3,
        causal=case.get("causal", False),
        bottom_right=case.get("bottom_right", False),
        window_size=case.get("window_size", (-1, -1)),
    )
    if case.get("padded"):
        kwargs.update(seqlens_q=torch.tensor([S_q, S_q - 3]), seqlens_kv=torch.tensor([S_kv, S_kv - 2]))
    return leaves, kwargs


def _varlen(case, seed):
    torch.manual_seed(seed)
    lengths_kv = [4, 1, 3]
    lengths_q = [min(2, n) for n in lengths_kv] if case.get("decode") else lengths_kv
    tail = 2  # a capacity tail past cu_seqlens[-1]
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_kv = torch.tensor([0] + torch.tensor(lengths_kv).cumsum(0).tolist(), dtype=torch.int32)
    H, H_kv, D = 4, 2, 8
    T_q, T_kv = int(cu_q[-1]) + tail, int(cu_kv[-1]) + tail
    leaves = [torch.randn(T_q, H, D), torch.randn(T_kv, H_kv, D), torch.randn(T_kv, H_kv, D)]
    if case.get("sinks"):
        leaves.append(torch.randn(H))
    kwargs = dict(
        scale=0.4,
        causal=case.get("causal", False),
        bottom_right=case.get("bottom_right", False),
        window_size=case.get("window_size", (-1, -1)),
    )
    return leaves, (cu_q, cu_kv, max(lengths_q), max(lengths_kv)), kwargs, tail


def _outputs_and_grads(fn, leaves, grad_seed):
    leaves = [t.clone().requires_grad_() for t in leaves]
    out, lse = fn(*leaves)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    return out, lse, torch.autograd.grad(out, leaves, grad_out)


def _compare(name, eager, compiled):
    for what, got, want in zip(("out", "lse"), compiled[:2], eager[:2]):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), f"{name} {what}: -inf rows differ"
        assert_close_rel(got[finite], want[finite], f"{name} {what}")
    for what, got, want in zip(("dq", "dk", "dv", "dsinks"), compiled[2], eager[2]):
        assert_close_rel(got, want, f"{name} {what}")


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_compiled_attention_equals_eager(name):
    leaves, kwargs = _dense(DENSE_CASES[name], seed=0)

    def fn(q, k, v, *sinks):
        return cudnn_attention.attention(q, k, v, sinks=sinks[0] if sinks else None, return_lse=True, **kwargs)

    eager = _outputs_and_grads(fn, leaves, grad_seed=1)
    compiled = _outputs_and_grads(torch.compile(fn, fullgraph=True, backend=BACKEND), leaves, grad_seed=1)
    _compare(name, eager, compiled)


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_compiled_varlen_attention_equals_eager(name):
    leaves, packing, kwargs, tail = _varlen(VARLEN_CASES[name], seed=2)

    def fn(q, k, v, *sinks):
        return cudnn_attention.varlen_attention(q, k, v, *packing, sinks=sinks[0] if sinks else None, return_lse=True, **kwargs)

    eager = _outputs_and_grads(fn, leaves, grad_seed=3)
    compiled = _outputs_and_grads(torch.compile(fn, fullgraph=True, backend=BACKEND), leaves, grad_seed=3)
    _compare(name, eager, compiled)
    assert compiled[0][-tail:].abs().max() == 0 and compiled[2][0][-tail:].abs().max() == 0, "capacity tail: zero output, zero gradient"


def test_the_public_functions_compile_directly():
    # torch.compile of the library functions themselves, as a user would write it.
    torch.manual_seed(4)
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    out = torch.compile(cudnn_attention.attention, fullgraph=True, backend=BACKEND)(q, q, q, causal=True)
    assert_close_rel(out, cudnn_attention.attention(q, q, q, causal=True), "attention")
    packed = torch.randn(6, 2, 8, requires_grad=True)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    args = (packed, packed, packed, cu, cu, 3, 3)
    out = torch.compile(cudnn_attention.varlen_attention, fullgraph=True, backend=BACKEND)(*args, causal=True)
    assert_close_rel(out, cudnn_attention.varlen_attention(*args, causal=True), "varlen_attention")


def test_compiled_calls_are_counted_per_call_in_both_directions():
    torch.manual_seed(5)
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    compiled = torch.compile(lambda q: cudnn_attention.attention(q, q, q, causal=True), fullgraph=True, backend=BACKEND)
    for _ in range(3):
        compiled(q).sum().backward()
    with torch.no_grad():
        compiled(q)
    stats = cudnn_attention.stats()
    assert stats["fallback_forward"] == {"cpu tensors": 4} and stats["fallback_backward"] == {"cpu tensors": 3}


def test_compiled_fallback_warns_once():
    # Once per reason, as in eager, although the graph runs the warning code on every call.
    torch.manual_seed(6)
    q = torch.randn(1, 2, 5, 8)
    compiled = torch.compile(lambda q: cudnn_attention.attention(q, q, q), fullgraph=True, backend=BACKEND)
    with pytest.warns(cudnn_attention.CudnnAttentionFallbackWarning, match="cpu tensors") as record:
        compiled(q)
        compiled(q)
    assert len([w for w in record if issubclass(w.category, cudnn_attention.CudnnAttentionFallbackWarning)]) == 1


def test_compiled_fallback_warning_names_the_compiled_code_line():
    # The graph's own frames are torch's: the warning once named policy.py, now the user's line in the compiled code.
    import sys

    q = torch.randn(1, 2, 5, 8)
    line = sys._getframe().f_lineno + 1
    compiled = torch.compile(lambda q: cudnn_attention.attention(q, q, q), fullgraph=True, backend=BACKEND)
    with pytest.warns(cudnn_attention.CudnnAttentionFallbackWarning, match="cpu tensors") as record:
        compiled(q)
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line)]


@pytest.mark.parametrize("entry", ["attention", "varlen_attention"])
def test_strict_mode_refuses_compiled_calls(entry):
    torch.manual_seed(7)
    if entry == "attention":
        q = torch.randn(1, 2, 5, 8, requires_grad=True)
        args = (q, q, q)
    else:
        q = torch.randn(6, 2, 8, requires_grad=True)
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        args = (q, q, q, cu, cu, 3, 3)
    compiled = torch.compile(getattr(cudnn_attention, entry), fullgraph=True, backend=BACKEND)
    with cudnn_attention.strict(), pytest.raises(cudnn_attention.StrictModeError, match="cpu tensors"):
        compiled(*args, causal=True)  # compiled inside the strict scope
    out = compiled(*args, causal=True)  # the same compiled function outside it: served by the fallback
    with cudnn_attention.strict(), pytest.raises(cudnn_attention.StrictModeError, match="cpu tensors"):
        compiled(*args, causal=True)  # compiled before strict was turned on: strict is read when the call runs
    cudnn_attention.set_strict(True)
    try:
        with pytest.raises(cudnn_attention.StrictModeError):
            compiled(*args, causal=True)
    finally:
        cudnn_attention.set_strict(None)
    assert cudnn_attention.stats()["fallback_forward"] == {"cpu tensors": 1}, "a refused call is not counted as served"
    assert torch.isfinite(out).all()


def test_compiled_packed_call_still_checks_cpu_prefix_sums():
    # Eager CPU calls check the prefix sums on the host; a compiled graph cannot branch on them, so it asserts them.
    q = torch.zeros(6, 2, 8)
    compiled = torch.compile(cudnn_attention.varlen_attention, fullgraph=True, backend=BACKEND)
    good = torch.tensor([0, 2, 5], dtype=torch.int32)
    compiled(q, q, q, good, good, 3, 3)
    for bad in ([0, 4, 2], [0, 3, 7], [1, 3, 5], [0, 1, 5]):  # decreasing, past T, not from 0, longer than max_seqlen
        cu = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="cu_seqlens_q/cu_seqlens_kv"):
            compiled(q, q, q, cu, cu, 3, 3)


# The padded core path and the packed one (an unpadded batch is the plain dense path, traced above and in
# test_hf_integration's compiled generation); each compile of the model costs seconds, so two.
@pytest.mark.parametrize("batch", ["padding mask", "packed flash kwargs"])
def test_compiled_transformers_model_equals_eager(batch):
    # A tiny Llama-like model (transformers.LlamaConfig) with attn_implementation="cudnn", compiled whole with fullgraph:
    # transformers' own code and this project's HF layer and core all trace, on the real CPU fallback.
    pytest.importorskip("transformers")
    from support.hf_models import build, documents, packed_batch

    model = build("llama", "cudnn")
    if batch == "packed flash kwargs":
        inputs = packed_batch(documents([5, 3, 4], seed=8))
    else:
        ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(8))
        inputs = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])}

    def logits_and_grads(forward):
        model.zero_grad(set_to_none=True)
        logits = forward(**inputs).logits
        logits.square().mean().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    want_logits, want_grads = logits_and_grads(model)
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    got_logits, got_grads = logits_and_grads(compiled)
    assert_close_rel(got_logits, want_logits, "logits")
    for name, want in want_grads.items():
        # Whole-model gradients sum over every token and layer: the accumulation order moves them by more ulps.
        scale = want.abs().max().clamp_min(1e-30)
        err = (got_grads[name] - want).abs().max()
        assert err <= 64 * RTOL32 * scale, f"{name}: max abs error {err:.3g} > {64 * RTOL32:.3g} x {scale:.3g}"
    layers = model.config.num_hidden_layers
    assert cudnn_attention.stats()["fallback_forward"] == {"cpu tensors": 2 * layers}, "eager and compiled forwards, every layer counted"
    assert cudnn_attention.stats()["fallback_backward"] == {"cpu tensors": 2 * layers}
    with cudnn_attention.strict(), pytest.raises(cudnn_attention.StrictModeError, match="cpu tensors"):
        compiled(**inputs)  # the graph compiled above, now run in a strict scope


def test_the_bookkeeping_op_stays_out_of_cuda_graphs():
    # A replayed CUDA graph runs no Python: the op must not be captured, or compiled calls would go uncounted and unrefused.
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    assert tag in torch.ops.cudnn_attention.noted_fallback.default.tags
