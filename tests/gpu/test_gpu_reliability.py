"""Regression tests for inputs the cuDNN path once served wrong or faulted on, on the GPU.

Each is checked against the package's fp32 reference (which the CPU suite pins to the tests' float64
one, ``support/reference64.py``) or against a plain identity, and, where a fault is possible, in a subprocess so that a
CUDA error is a failing test rather than a dead suite.
"""

import pytest
import torch

import cudnn_attention
from cudnn_attention.masking import make_mask_spec
from cudnn_attention.reference import dense_reference, varlen_reference
from support.child_process import run_python
from support.gpu_checks import check_dense, poison_allocator
from support.tolerances import assert_within_lowp_noise

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _dense(B=3, H=4, H_kv=2, S=64, D=64, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(B, H if i == 0 else H_kv, S, D, device=DEVICE, dtype=dtype, requires_grad=True) for i in range(3)]


@pytest.mark.parametrize("seqlens_q, seqlens_kv", [([62, 0, 52], [62, 0, 52]), ([4, 12, 9], [0, 12, 9]), ([0, 64, 3], [64, 0, 3])])
def test_rows_without_queries_or_keys_are_zero_with_zero_gradient(seqlens_q, seqlens_kv):
    q, k, v = _dense()
    poison_allocator(q, q, q)  # stale NaN where a kernel leaves rows unwritten
    lengths = (torch.tensor(seqlens_q, device=DEVICE), torch.tensor(seqlens_kv, device=DEVICE))
    for _ in range(3):  # the stale memory differed from call to call
        out, grads = check_dense(dict(causal=True), q, k, v, None, lengths)
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        for b, (n_q, n_kv) in enumerate(zip(seqlens_q, seqlens_kv)):
            if n_q == 0 or n_kv == 0:
                assert out[b].abs().max() == 0 and grads[0][b].abs().max() == 0
                assert grads[1][b].abs().max() == 0 and grads[2][b].abs().max() == 0


def test_negative_and_oversized_lengths_are_clamped_like_on_cpu():
    q, k, v = _dense()
    got = cudnn_attention.attention(
        q, k, v, causal=True, seqlens_q=torch.tensor([-3, 70, 5], device=DEVICE), seqlens_kv=torch.tensor([10, 99, -1], device=DEVICE)
    )
    want = cudnn_attention.attention(
        q, k, v, causal=True, seqlens_q=torch.tensor([0, 64, 5], device=DEVICE), seqlens_kv=torch.tensor([10, 64, 0], device=DEVICE)
    )
    cpu = cudnn_attention.attention(
        *(t.detach().cpu().float() for t in (q, k, v)),
        causal=True,
        seqlens_q=torch.tensor([-3, 70, 5]),
        seqlens_kv=torch.tensor([10, 99, -1]),
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[0].abs().max() == 0 and got[2].abs().max() == 0
    torch.testing.assert_close(got.float().cpu(), cpu, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scale", [0.0, -0.125, -1.0])
@pytest.mark.parametrize("packed", [False, True])
def test_non_positive_scale_is_served_exactly_by_cudnn(scale, packed):
    q, k, v = _dense(B=2, S=96)
    mask = make_mask_spec(causal=True, bottom_right=False, window_size=(-1, -1))
    if packed:
        cu = torch.tensor([0, 30, 96], device=DEVICE, dtype=torch.int32)
        q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        run = lambda *t: cudnn_attention.varlen_attention(*t, cu, cu, 66, 66, causal=True, scale=scale)  # noqa: E731
        ref = lambda *t, dtype: varlen_reference(*t, cu, cu, 66, 66, scale=scale, mask=mask, compute_dtype=dtype)[0]  # noqa: E731
    else:
        run = lambda *t: cudnn_attention.attention(*t, causal=True, scale=scale)  # noqa: E731
        ref = lambda *t, dtype: dense_reference(*t, scale=scale, mask=mask, compute_dtype=dtype)[0]  # noqa: E731
    grad_out = torch.randn(q.shape[:-1] + v.shape[-1:], device=DEVICE, dtype=q.dtype)
    with cudnn_attention.strict():
        out = run(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert cudnn_attention.stats()["cudnn_backward"] == 1
    results = {}
    for dtype in (torch.float32, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        expected = ref(*leaves, dtype=dtype)
        results[dtype] = (expected, torch.autograd.grad(expected, leaves, grad_out.to(dtype)))
    for name, got, want, base in zip(
        ("out", "dq", "dk", "dv"),
        (out, *grads),
        (results[torch.float32][0], *results[torch.float32][1]),
        (results[q.dtype][0], *results[q.dtype][1]),
    ):
        assert torch.isfinite(got).all(), name
        assert_within_lowp_noise(name, got, want, base)


def test_sdpa_provider_with_zero_scale_matches_math():
    q, k, v = (t.detach() for t in _dense(B=2, H=4, H_kv=4, S=128))
    with cudnn_attention.enabled():
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.0)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_nan_sink_gives_nan_for_its_head_only():
    q, k, v = (t.detach() for t in _dense(B=2, H=4, H_kv=2, S=64))
    sinks = torch.zeros(4, device=DEVICE)
    sinks[1] = float("nan")
    for device in (DEVICE, "cpu"):
        out = cudnn_attention.attention(*(t.to(device) for t in (q, k, v)), causal=True, sinks=sinks.to(device))
        assert out[:, 1].isnan().all(), device
        assert torch.isfinite(out[:, [0, 2, 3]]).all(), device


def test_empty_packed_input_returns_empty():
    q = torch.randn(0, 4, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.zeros(2, device=DEVICE, dtype=torch.int32)
    with cudnn_attention.strict():  # nothing to compute is not a fallback
        out = cudnn_attention.varlen_attention(q, q, q, cu, cu, 0, 0)
    assert out.shape == (0, 4, 64)
    # Every document empty, with tokens present (a capacity tail): zeros.
    q = torch.randn(8, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    assert cudnn_attention.varlen_attention(q, q, q, cu, cu, 0, 0).abs().max() == 0


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_interleaved_qkv_packed_backward_is_right_and_does_not_fault(head_dim):
    result = run_python(f"""
        import torch, cudnn_attention
        from cudnn_attention.reference import varlen_reference
        from cudnn_attention.masking import make_mask_spec
        torch.manual_seed(0)
        T, H, D = 700, 8, {head_dim}
        cu = torch.tensor([0, 1, 300, 640, 700], device="cuda", dtype=torch.int32)
        qkv = torch.randn(T, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = qkv.unbind(1)
        grad = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        with cudnn_attention.strict():
            out = cudnn_attention.varlen_attention(q, k, v, cu, cu, 340, 340, causal=True)
            (dqkv,) = torch.autograd.grad(out, qkv, grad)
        torch.cuda.synchronize()
        leaf = qkv.detach().float().requires_grad_()
        ref, _ = varlen_reference(*leaf.unbind(1), cu, cu, 340, 340, scale=D ** -0.5, mask=make_mask_spec(causal=True, bottom_right=False,
                                  window_size=(-1, -1)))
        (dref,) = torch.autograd.grad(ref, leaf, grad.float())
        for name, got, want in (("out", out, ref), ("dqkv", dqkv, dref)):
            err = (got.float() - want).abs().max().item() / want.abs().max().item()
            assert err < 2e-2, (name, err)
        print("ok", cudnn_attention.stats()["cudnn_backward"])
    """)
    assert result.returncode == 0 and "ok 1" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize(
    "cu_q, max_q",
    # past_T: the last document (5 tokens) within max_q, its end past the 12 tokens (a max_q above 12 is refused on the host).
    [([0, 4, 2, 8], 8), ([0, 4, 8, 13], 5), ([0, 4, 8, 12], 3), ([2, 4, 8, 12], 8)],
    ids=["decreasing", "past_T", "longer_than_max", "not_from_zero"],
)
def test_invalid_prefix_sums_without_validate_stop_loudly(cu_q, max_q):
    result = run_python(f"""
        import torch, cudnn_attention
        q = torch.randn(12, 4, 64, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.tensor({cu_q}, device="cuda", dtype=torch.int32)
        cu_kv = torch.tensor([0, 4, 8, 12], device="cuda", dtype=torch.int32)
        out = cudnn_attention.varlen_attention(q, q, q, cu_q, cu_kv, {max_q}, 4, causal=True)
        torch.cuda.synchronize()
        print("returned", out.float().abs().sum().item())
    """)
    assert result.returncode != 0 and "returned" not in result.stdout, result.stdout
    assert "illegal memory access" not in result.stderr and "assert" in result.stderr.lower(), result.stderr[-3000:]


def test_prefix_sum_check_does_not_synchronize():
    q = torch.randn(12, 4, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 4, 8, 12], device=DEVICE, dtype=torch.int32)
    cudnn_attention.varlen_attention(q, q, q, cu, cu, 4, 4, causal=True)  # graphs built outside the checked region
    torch.cuda.synchronize()
    fresh = cu.clone()  # not yet checked: the device-side check runs in the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = cudnn_attention.varlen_attention(q, q, q, fresh, fresh, 4, 4, causal=True)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("padded", [False, True])
def test_single_query_with_sinks_stays_on_cudnn(padded):
    # cuDNN 9.19's sink engine declines s_q == 1 (every gpt-oss decode step); the sink-less graph and the LSE fold serve it.
    torch.manual_seed(5)
    q = torch.randn(2, 4, 1, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 77, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    lengths = (None, torch.tensor([77, 30], device=DEVICE)) if padded else (None, None)
    check_dense(dict(causal=True, bottom_right=True), q, k, v, sinks, lengths)


_DSINK_GRID = [  # (layout, lengths, H, H_kv, D, causal, window_left); bf16 q/k/v, float32 sinks
    ("packed", [15, 13], 2, 1, 64, False, -1),
    ("packed", [28], 4, 2, 64, True, -1),
    ("packed", [300, 200, 500], 8, 2, 64, True, -1),
    ("packed", [1000, 24], 8, 2, 128, True, 127),
    ("dense", [16, 16], 4, 4, 32, True, -1),
    ("dense", [256, 100], 8, 2, 128, False, -1),
    ("dense", [2048], 16, 4, 64, True, 127),
]


def test_dsink_error_over_a_grid(capsys):
    """The dSink reduction is float32 end to end. Over a grid of sizes, dSink equals the
    float64 identity applied to the kernel's own O and LSE to float32 accuracy, and its error against the
    float64 reference is within FlashAttention's rule (the error the kernel's bf16 O implies is printed beside the
    flash-style and bf16-autograd errors, as a table, not allowed for, with the LSE's share and the mean biases of O and the
    LSE that a systematic error would show)."""
    from support.reference64 import (
        compare_tensors,
        dsinks_error_sources,
        flash_style_dsinks,
        reference_attention,
        reference_varlen_attention,
    )

    rows, checks = [], []
    for layout, lengths, H, H_kv, D, causal, left in _DSINK_GRID:
        torch.manual_seed(len(rows))
        window = (left, -1 if not causal else 0)
        if layout == "packed":
            T, longest = sum(lengths), max(lengths)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
            shapes = [(T, h, D) for h in (H, H_kv, H_kv)]
            call = lambda q, k, v, s: cudnn_attention.varlen_attention(  # noqa: E731
                q, k, v, cu, cu, longest, longest, window_size=window, sinks=s, return_lse=True
            )
            ref_call = lambda q, k, v, s, dt: reference_varlen_attention(  # noqa: E731
                q, k, v, cu, cu, window_size=window, sinks=s, return_lse=True, compute_dtype=dt
            )
        else:
            B, S = len(lengths), max(lengths)
            seqlens = torch.tensor(lengths, device=DEVICE, dtype=torch.int32)
            shapes = [(B, h, S, D) for h in (H, H_kv, H_kv)]
            call = lambda q, k, v, s: cudnn_attention.attention(  # noqa: E731
                q, k, v, window_size=window, sinks=s, seqlens_q=seqlens, seqlens_kv=seqlens, return_lse=True
            )
            ref_call = lambda q, k, v, s, dt: reference_attention(  # noqa: E731
                q, k, v, window_size=window, sinks=s, seqlens_q=seqlens, seqlens_kv=seqlens, return_lse=True, compute_dtype=dt
            )
        q, k, v = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) for shape in shapes)
        sinks = torch.randn(H, device=DEVICE, requires_grad=True)
        out, lse = call(q, k, v, sinks)
        grad_out = torch.randn_like(out)
        (dsinks,) = torch.autograd.grad(out, sinks, grad_out)
        sinks64 = sinks.detach().double().requires_grad_()
        out64, lse64 = ref_call(q.double(), k.double(), v.double(), sinks64, torch.float64)
        (dsinks64,) = torch.autograd.grad(out64, sinks64, grad_out.double())
        sinks_low = sinks.detach().clone().requires_grad_()
        out_low, _ = ref_call(q, k, v, sinks_low, torch.bfloat16)
        (dsinks_low,) = torch.autograd.grad(out_low, sinks_low, grad_out)
        own = flash_style_dsinks(out, lse, grad_out, sinks64.detach(), torch.float64)  # the identity on our own O and LSE
        flash_dsinks = flash_style_dsinks(out64, lse64, grad_out, sinks64.detach(), torch.bfloat16)
        sources = dsinks_error_sources(out, lse, out64, lse64, grad_out, sinks64)
        # err <= 2 * max(flash, low) + 1e-3 * max|dSink|: FlashAttention's rule with a 1e-3 floor, with no allowance for the
        # error the kernel's own O implies (printed beside it).
        check = compare_tensors("dsinks", dsinks, dsinks64, dsinks_low, floor_rel=1e-3, flash=flash_dsinks)
        checks.append(check)
        scale = dsinks64.abs().max().item()  # the table's errors are relative to max|dSink|
        reduction = (dsinks.double() - own).abs().max().item() / scale
        err, by_out, by_lse = check["err"] / scale, sources["by_out"] / scale, sources["by_lse"] / scale
        flash = (flash_dsinks.double() - dsinks64).abs().max().item() / scale
        low = (dsinks_low.double() - dsinks64).abs().max().item() / scale
        rows.append((layout, lengths, H, D, window, reduction, err, by_out, by_lse, sources["out_scale"], sources["lse_shift"], flash, low))
    with capsys.disabled():
        print(
            "\n| layout | lengths | H | D | window | reduction vs fp64 identity on own O | dSink err | from its O | from its LSE | "
            "O scale bias | LSE shift | flash-style (bf16 O) | bf16 autograd |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for layout, lengths, H, D, window, reduction, err, by_out, by_lse, out_scale, lse_shift, flash, low in rows:
            print(
                f"| {layout} | {lengths} | {H} | {D} | {window} | {reduction:.1e} | {err:.2e} | {by_out:.2e} | {by_lse:.2e} | "
                f"{out_scale:.1e} | {lse_shift:.1e} | {flash:.2e} | {low:.2e} |"
            )
    # Asserted after the table, so a failing run still shows where each error comes from.
    for row, check in zip(rows, checks):
        assert row[5] <= 1e-5, row  # the reduction is float32 end to end (a bf16 step would be ~4e-3)
        assert check["ok"], (*row[:5], check["why"])


def test_a_short_script_exits_without_the_frontends_leak_report():
    # nanobind reports every frontend instance still alive at interpreter teardown (hundreds of lines on stderr); a short
    # script must exit without that report, or every user's run would end in it.
    result = run_python("""
        import torch, cudnn_attention
        q = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cu = torch.tensor([0, 30, 64], device="cuda", dtype=torch.int32)
        cudnn_attention.attention(q, q, q, causal=True).sum().backward()
        t = q.detach()[0].transpose(0, 1).contiguous().requires_grad_()
        cudnn_attention.varlen_attention(
            t, t, t, cu, cu, 34, 34, causal=True, sinks=torch.zeros(4, device="cuda", requires_grad=True)
        ).sum().backward()
        assert cudnn_attention.stats()["cudnn_backward"] == 2, cudnn_attention.stats()
        print("done")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stdout + result.stderr
    assert "nanobind" not in result.stderr and "leaked" not in result.stderr, result.stderr[-2000:]


def test_one_visible_key_gives_exactly_zero_dq_and_dk():
    # Every softmax row is exactly 1, so the output's gradient reaches neither q nor k; cuDNN's dP - D (two float32 sums in
    # different orders) once left dK = 2.2e-4 here (B 1, S_q 1500 with 152 real queries, one key, D 192, scale 1, causal).
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1500, 192, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 4, 1, 192, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cudnn_attention.reset_stats()
    with cudnn_attention.strict():
        out = cudnn_attention.attention(q, k, v, causal=True, scale=1.0, seqlens_q=torch.tensor([152], device=DEVICE))
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert cudnn_attention.stats()["cudnn_backward"] == 1
    assert dq.abs().max() == 0 and dk.abs().max() == 0 and dv.abs().max() > 0
