"""Bad input raises a clear error naming the offending value, before any kernel runs."""

import pytest
import torch

import cudnn_attention


def dense(B=2, H=4, H_kv=2, S=5, D=8, dtype=torch.float32):
    return torch.randn(B, H, S, D, dtype=dtype), torch.randn(B, H_kv, S, D, dtype=dtype), torch.randn(B, H_kv, S, D, dtype=dtype)


def packed(T=6, H=4, H_kv=2, D=8):
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return torch.randn(T, H, D), torch.randn(T, H_kv, D), torch.randn(T, H_kv, D), cu


@pytest.mark.parametrize(
    "mutate, error, pattern",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D \(B, H, S, D\), got shape \(4, 5, 8\)"),
        (lambda q, k, v: (q, k.half(), v), ValueError, r"share one dtype.*k=torch.float16"),
        (lambda q, k, v: (q, k, v.to("meta")), ValueError, r"one device.*v=meta"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"batch sizes differ: q 2, k 1, v 1"),
        (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, r"same number of keys"),
        (lambda q, k, v: (q, k[:, :, :, :4], v), ValueError, r"same head dim, got 8 and 4"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, r"q must be a floating-point tensor, got torch.int32"),
        (lambda q, k, v: (q.tolist(), k, v), TypeError, r"q must be a torch.Tensor, got list"),
    ],
)
def test_dense_shape_and_type_errors(mutate, error, pattern):
    with pytest.raises(error, match=pattern):
        cudnn_attention.attention(*mutate(*dense()))


@pytest.fixture(params=[False, True], ids=["fresh", "after a remembered call"])
def remembered(request):
    """Whether the valid call each error case mutates was served (and so remembered) first: a remembered
    call's signature must never let a bad one skip its checks."""
    if request.param:
        request.getfixturevalue("served_on_cpu")
    return request.param


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(causal=True, window_size=(4, 2)), ValueError, r"causal=True hides every future key but window_size=\(4, 2\) admits 2"),
        (dict(window_size=(3,)), ValueError, r"window_size must be a \(left, right\) pair, got \(3,\)"),
        (dict(window_size=(-2, 0)), ValueError, r"left bound must be >= 0, or -1 for unbounded; got -2"),
        (dict(window_size=(1.5, 0)), TypeError, r"left bound must be an int, got 1.5"),
        (dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(4,\).*got \(3,\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, r"sinks must be a floating-point tensor"),
        (dict(seqlens_q=torch.tensor([1, 2, 3])), ValueError, r"seqlens_q must have shape \(2,\).*got \(3,\)"),
        (dict(seqlens_kv=torch.tensor([1.0, 2.0])), TypeError, r"seqlens_kv must be int32 or int64, got torch.float32"),
        (dict(seqlens_q=torch.tensor([1, 9]), validate=True), ValueError, r"seqlens_q must lie in \[0, 5\], got \[1, 9\]"),
        (dict(scale=float("nan")), ValueError, r"scale must be finite, got nan"),
        (dict(scale="0.1"), TypeError, r"scale must be a float or None, got '0.1'"),
        # A yes/no argument's truth would decide silently: "false" reads as true.
        (dict(causal="false"), TypeError, r"causal must be a bool, got 'false' \(str\)"),
        (dict(bottom_right=1), TypeError, r"bottom_right must be a bool, got 1 \(int\)"),
        (dict(return_lse="no"), TypeError, r"return_lse must be a bool, got 'no' \(str\)"),
        (dict(validate="yes"), TypeError, r"validate must be a bool, got 'yes' \(str\)"),
    ],
)
def test_dense_option_errors(kwargs, error, pattern, remembered):
    q, k, v = dense()
    if remembered:
        cudnn_attention.attention(q, k, v, **{name: value for name, value in _VALID.items() if name in kwargs})
    with pytest.raises(error, match=pattern):
        cudnn_attention.attention(q, k, v, **kwargs)


# Valid values of each option, of the type the documentation gives; the type matters: ``True == 1 == 1.0`` as keys.
_VALID = dict(
    window_size=(1, 0),
    sinks=torch.zeros(4),
    seqlens_q=torch.tensor([1, 2]),
    seqlens_kv=torch.tensor([1, 2]),
    scale=1.0,
    causal=False,
    bottom_right=False,
    return_lse=False,
    validate=False,
    max_seqlen_q=4,
    max_seqlen_kv=4,
)


@pytest.mark.parametrize(
    "valid, bad, error, pattern",
    [
        (dict(scale=1.0), dict(scale=True), TypeError, r"scale must be a float or None, got True"),
        (dict(window_size=(1, 0)), dict(window_size=(1.0, 0)), TypeError, r"left bound must be an int, got 1.0"),
        (dict(window_size=(1, 0)), dict(window_size=(True, 0)), TypeError, r"left bound must be an int, got True"),
        (dict(return_lse=True), dict(return_lse=1), TypeError, r"return_lse must be a bool, got 1"),
        (dict(causal=True), dict(causal=1), TypeError, r"causal must be a bool, got 1"),
    ],
)
def test_an_equal_option_of_another_type_is_still_checked(served_on_cpu, valid, bad, error, pattern):
    q, k, v = dense()
    cudnn_attention.attention(q, k, v, **valid)
    cudnn_attention.attention(q, k, v, **valid)
    assert served_on_cpu["resolve"] == 1 and served_on_cpu["launch"] == 2  # the second call was the remembered one
    with pytest.raises(error, match=pattern):
        cudnn_attention.attention(q, k, v, **bad)


@pytest.mark.parametrize(
    "mutate, error, pattern",
    [
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].float()}, TypeError, r"cu_seqlens_q must be int32 or int64, got torch.float32"),
        (
            lambda a: {**a, "cu_seqlens_kv": a["cu_seqlens_kv"][None]},
            ValueError,
            r"cu_seqlens_kv must be 1-D with B \+ 1 >= 2 entries, got shape \(1, 3\)",
        ),
        (lambda a: {**a, "cu_seqlens_kv": torch.tensor([0, 6], dtype=torch.int32)}, ValueError, r"different batch sizes: 2 and 1"),
        (lambda a: {**a, "max_seqlen_q": -1}, ValueError, r"max_seqlen_q must be >= 0, got -1"),
        # CPU prefix sums are checked even without validate=True (it costs no device sync there).
        (lambda a: {**a, "max_seqlen_q": 0}, ValueError, r"has 4 tokens, more than max_seqlen_q 0"),
        (lambda a: {**a, "cu_seqlens_kv": torch.tensor([0, 4, 2], dtype=torch.int32)}, ValueError, r"cu_seqlens_kv must be non-decreasing"),
        (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 2, 9], dtype=torch.int32)}, ValueError, r"cu_seqlens_q\[-1\] = 9 exceeds"),
        (lambda a: {**a, "q": a["q"][..., :0], "k": a["k"][..., :0]}, ValueError, r"head dim must be >= 1, got q/k head dim 0"),
        (lambda a: {**a, "max_seqlen_kv": torch.tensor(4)}, TypeError, r"max_seqlen_kv must be a Python int"),
        (lambda a: {**a, "q": a["q"][None]}, ValueError, r"q must be 3-D \(T, H, D\)"),
        (
            lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 4, 2], dtype=torch.int32), "validate": True},
            ValueError,
            r"non-decreasing, but entry 2 \(2\) < entry 1 \(4\)",
        ),
        (
            lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 2, 9], dtype=torch.int32), "validate": True},
            ValueError,
            r"cu_seqlens_q\[-1\] = 9 exceeds the 6 packed tokens",
        ),
        (
            lambda a: {**a, "cu_seqlens_q": torch.tensor([1, 2, 6], dtype=torch.int32), "validate": True},
            ValueError,
            r"must start at 0, got 1",
        ),
        (lambda a: {**a, "max_seqlen_q": 3, "validate": True}, ValueError, r"has 4 tokens, more than max_seqlen_q 3"),
        (lambda a: {**a, "max_seqlen_kv": -1}, ValueError, r"max_seqlen_kv must be >= 0, got -1"),
        (lambda a: {**a, "causal": "no"}, TypeError, r"causal must be a bool, got 'no' \(str\)"),
    ],
)
def test_varlen_errors(mutate, error, pattern, remembered):
    q, k, v, cu = packed()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    if remembered:
        cudnn_attention.varlen_attention(**args)
    with pytest.raises(error, match=pattern):
        cudnn_attention.varlen_attention(**mutate(args))


def test_a_maximum_of_another_type_is_still_checked(served_on_cpu):
    q, k, v, cu = packed()
    for _ in range(2):
        cudnn_attention.varlen_attention(q, k, v, cu, cu, 4, 4)
    assert served_on_cpu["resolve"] == 1 and served_on_cpu["launch"] == 2
    with pytest.raises(TypeError, match=r"max_seqlen_q must be a Python int, got 4.0"):
        cudnn_attention.varlen_attention(q, k, v, cu, cu, 4.0, 4)


def test_numpy_bools_are_bools():
    np = pytest.importorskip("numpy")
    q, k, v = dense()
    torch.testing.assert_close(
        cudnn_attention.attention(q, k, v, causal=np.bool_(True), return_lse=np.True_)[0], cudnn_attention.attention(q, k, v, causal=True)
    )


def test_options_are_keyword_only():
    q, k, v = dense()
    with pytest.raises(TypeError):
        cudnn_attention.attention(q, k, v, 0.1)  # scale must be named


def test_strided_head_dim_is_copied_and_served():
    q, k, v = dense(D=16)
    q_strided = q[..., ::2]
    with pytest.warns(cudnn_attention.CudnnAttentionCopyWarning, match="innermost stride 2"):
        out = cudnn_attention.attention(q_strided, k[..., ::2], v)
    expected = cudnn_attention.attention(q_strided.contiguous(), k[..., ::2].contiguous(), v)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_strided_sinks_reach_the_kernel_contiguous(served_on_cpu, monkeypatch):
    # The kernels read the sinks as H consecutive float32 values (cuDNN's (1, H, 1, 1) descriptor, the fold's sinks_ptr + h):
    # a strided view, e.g. every other entry of a fused parameter, would be read as the wrong logits without a word.
    from cudnn_attention import api

    seen = []
    launch = api.cudnn_forward

    def recording(plan, call, q, k, v, *, sinks, lengths):
        seen.append((tuple(sinks.shape), sinks.is_contiguous()))
        return launch(plan, call, q, k, v, sinks=sinks, lengths=lengths)

    monkeypatch.setattr(api, "cudnn_forward", recording)
    q, k, v = dense()
    strided = torch.randn(8)[::2]
    out = cudnn_attention.attention(q, k, v, sinks=strided)
    q_p, k_p, v_p, cu = packed()
    cudnn_attention.varlen_attention(q_p, k_p, v_p, cu, cu, 4, 4, sinks=strided)
    assert seen == [((4,), True), ((4,), True)]
    torch.testing.assert_close(out, cudnn_attention.attention(q, k, v, sinks=strided.contiguous()), rtol=0, atol=0)
