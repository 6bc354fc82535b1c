"""Fake (meta) kernels report the shapes and strides the real kernels produce."""

import itertools

import torch

import cudnn_attention  # noqa: F401 - registers the ops
from cudnn_attention.layouts import allocate_forward_outputs, like_layout_strides, packed_bounds, shape_bucket, token_major


def _forward(q, k, v, *, packed=False, need_lse=True, cu=None, max_len=0):
    return torch.ops.cudnn_attention.forward(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        scale=0.125,
        window_right=0,
        need_lse=need_lse,
    )


def test_dense_fake_output_adopts_query_layout():
    q_BSHD = torch.empty(2, 7, 4, 64, device="meta", dtype=torch.bfloat16)
    kv_BSHD = torch.empty(2, 7, 2, 64, device="meta", dtype=torch.bfloat16)
    q = q_BSHD.transpose(1, 2)
    out, lse = _forward(q, kv_BSHD.transpose(1, 2), kv_BSHD.transpose(1, 2))
    assert out.shape == (2, 4, 7, 64) and out.dtype == torch.bfloat16
    assert out.stride() == q.stride() == (7 * 4 * 64, 64, 4 * 64, 1)
    assert out.transpose(1, 2).is_contiguous(), "transformers reshapes (B, S, H, D) without a copy"
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32


def test_fake_without_lse_returns_empty_lse():
    q = torch.empty(1, 2, 3, 64, device="meta", dtype=torch.float16)
    out, lse = _forward(q, q, q, need_lse=False)
    assert out.stride() == q.stride() and lse.numel() == 0


def test_packed_fake_shapes_and_backward_fake():
    q = torch.empty(10, 4, 64, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(10, 2, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    out, lse = _forward(q, kv, kv, cu=cu, max_len=5)
    assert out.shape == (10, 4, 64) and out.is_contiguous() and lse.shape == (10, 4)
    sinks = torch.empty(4, device="meta")
    options = dict(sinks=sinks, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5, scale=0.125, window_right=0)
    dq, dk, dv, dsinks = torch.ops.cudnn_attention.backward(out, q, kv, kv, out, lse, **options)
    assert dq.shape == q.shape and dk.shape == kv.shape and dv.shape == kv.shape and dsinks.shape == (4,)
    # A loss that uses the LSE alone: no output gradient, an LSE one; the same outputs.
    grads = torch.ops.cudnn_attention.backward(None, q, kv, kv, out, lse, lse, **options)
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in (dq, dk, dv, dsinks)]


def test_dense_backward_fake_grads_adopt_input_layouts():
    q = torch.empty(2, 5, 4, 64, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(2, 2, 5, 64, device="meta", dtype=torch.bfloat16)
    out, lse = _forward(q, k, k)
    dq, dk, dv, dsinks = torch.ops.cudnn_attention.backward(out, q, k, k, out, lse, lse, scale=0.125, window_right=0)
    assert dq.stride() == q.stride() and dk.stride() == k.stride() and dsinks.numel() == 0


def test_real_allocation_helper_matches_fake_on_cpu():
    q = torch.empty(2, 5, 4, 64).transpose(1, 2)
    out, _ = allocate_forward_outputs(q, q, packed=False, need_lse=True)
    fake_out, _ = _forward(q.to("meta"), q.to("meta"), q.to("meta"))
    assert out.stride() == fake_out.stride()


def test_like_layout_strides_orders_and_broadcasts():
    t = torch.empty(2, 3, 5, 7).permute(0, 2, 1, 3)  # (2, 5, 3, 7) physically (2, 3, 5, 7)
    assert like_layout_strides((2, 5, 3, 9), t) == (135, 9, 45, 1)
    broadcast = torch.empty(1, 3, 1, 7).expand(2, 3, 5, 7)
    assert like_layout_strides((2, 3, 5, 7), broadcast) == (105, 35, 7, 1)


def test_shape_bucket_is_monotone_and_bounded():
    previous = 0
    for n in range(1, 5000):
        bucket = shape_bucket(n, 64)
        assert bucket >= max(n, 64) and bucket >= previous
        assert bucket <= max(64, n) * 1.5 + 1, f"bucket {bucket} for {n} wastes more than half a bucket"
        previous = bucket
    assert len({shape_bucket(n, 64) for n in range(1, 32769)}) <= 21


def test_packed_bounds_hold_every_document_within_one_octave():
    for documents, max_seqlen in itertools.product(range(1, 70), (1, 63, 64, 65, 700, 2048, 4095, 4096)):
        for tokens in {max(documents, max_seqlen), documents * max_seqlen, 4096, 16384}:
            if not (max(documents, max_seqlen) <= tokens <= documents * max_seqlen):
                continue  # not a possible pack
            batch, seq = packed_bounds(documents=documents, max_seqlen=max_seqlen, tokens=tokens)
            assert documents <= batch < 2 * documents, (documents, max_seqlen, tokens)
            assert max_seqlen <= seq < 2 * max(max_seqlen, 64) and seq <= shape_bucket(tokens, 64), (documents, max_seqlen, tokens)


def test_token_major_copies_every_packed_layout_but_the_compact_one():
    head_major = torch.randn(4, 10, 8).transpose(0, 1)  # (T, H, D) view of (H, T, D) memory: gpt-oss after RoPE
    copied = token_major(head_major)
    assert copied.is_contiguous() and torch.equal(copied, head_major)
    # q sliced out of a fused qkv projection, and FlashAttention's qkv-packed (T, 3, H, D): token stride > H * D,
    # which cuDNN's packed backward reads out of bounds.
    for interleaved in (torch.randn(10, 3 * 4 * 8)[:, : 4 * 8].view(10, 4, 8), torch.randn(10, 3, 4, 8).unbind(1)[1]):
        copied = token_major(interleaved)
        assert copied.is_contiguous() and torch.equal(copied, interleaved)
    contiguous = torch.randn(10, 4, 8)
    assert token_major(contiguous) is contiguous


def test_the_eager_shortcut_is_taken_only_without_dispatch_modes_or_subclasses():
    # cudnn_forward skips the dispatcher only when nothing between the caller and the kernels must see the op.
    from torch.utils._python_dispatch import TorchDispatchMode

    from cudnn_attention import _compat
    from cudnn_attention.cudnn_ops import _eager_safe

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 1, 4, 8)
    assert _compat.plain_dispatch() and _eager_safe(q, q, q)
    with Watching():
        assert not _compat.plain_dispatch() and not _eager_safe(q, q, q)
    assert not _eager_safe(torch.nn.Parameter(q), q, q)
    seen = []
    torch.func.grad(lambda x: (seen.append(_compat.plain_dispatch()), x.sum())[1])(q)
    assert seen == [False]  # functorch transforms see the op (they need its setup_context form)
