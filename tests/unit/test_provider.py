"""The provider's lifecycle (install/remove/enabled, SDP settings, torch's registry) and, on CPU, its plumbing.

The overrides are CUDA kernels, so a CPU-only torch never runs them. The plumbing tests register
the same kernel functions at the CPU key, with CPU stand-ins for this project's ops (the exact
reference, tests/provider_cpu.py) and for torch's cuDNN worker ops (plain math): they check that
torch's autograd formulas, our kernels and the ops they call agree on every argument and output,
and that each path is counted. The GPU tests (tests/test_gpu_provider.py) check the real kernels.
The varlen kernels against every torch release's schema: tests/test_provider_varlen_schemas.py;
other providers of the same kernels: tests/test_provider_conflicts.py.
"""

import itertools
import pathlib

import pytest
import torch
import torch.nn.functional as F

import cudnn_attention
from cudnn_attention import _compat, batch_chunks, errata, head_groups, provider, sdpa_overrides
from support.child_process import python_output
from support.provider_cpu import DENSE_OPS, VARLEN_OPS, in_fresh_thread, our_ops_on_cpu, per_document_reference


def _ours_registered(op: str) -> bool:
    # The dispatcher records where each kernel was registered: ours name provider.py.
    return any(where.startswith(provider.__file__) for where in _compat.kernel_registrations(op, "CUDA"))


# ----------------------------------------------------------------------------------------------
# Lifecycle
# ----------------------------------------------------------------------------------------------


def test_install_is_idempotent_and_remove_restores_torch_kernels():
    assert not any(_ours_registered(op) for op in DENSE_OPS + VARLEN_OPS)
    handle = cudnn_attention.install()
    assert handle.active and provider.current() is handle
    assert cudnn_attention.install() is handle  # same live handle, nothing registered twice
    assert all(_ours_registered(op) for op in DENSE_OPS + VARLEN_OPS)
    assert set(handle.overridden_ops) == set(DENSE_OPS + VARLEN_OPS)
    registrations = _compat.kernel_registrations("aten::_scaled_dot_product_cudnn_attention", "CUDA")
    ours = [where for where in registrations if where.startswith(provider.__file__)]
    # Ours once, and the one that runs; a CUDA build of torch lists its own kernel after it (shadowed), a CPU build none.
    assert len(ours) == 1 and registrations[0] == ours[0], registrations
    assert all(provider._registered_by(where) == "torch" for where in registrations[1:]), registrations
    handle.remove()
    assert not handle.active and provider.current() is None
    assert not any(_ours_registered(op) for op in DENSE_OPS + VARLEN_OPS)
    handle.remove()  # idempotent
    again = cudnn_attention.install()  # a fresh installation after a removal
    assert again is not handle and again.active
    again.remove()
    assert not any(_ours_registered(op) for op in DENSE_OPS + VARLEN_OPS)


def test_install_refuses_a_replace_existing_that_is_not_a_bool():
    # "no" read as true, and shadowed another provider's kernels the caller meant to keep.
    with pytest.raises(TypeError, match=r"replace_existing must be a bool, got 'no' \(str\)"):
        cudnn_attention.install(replace_existing="no")
    assert provider.current() is None


def test_install_without_cuda_says_no_call_will_reach_it(monkeypatch):
    # On a CPU machine the handle said active while torch's CPU kernel ran every call, stats()["provider"] at 0, no word.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match=r"install\(\): this machine has no CUDA device") as caught:
        handle = cudnn_attention.install()
    try:
        assert caught[0].category is cudnn_attention.ProviderUnusedWarning and caught[0].filename == __file__
        assert "attn_implementation='cudnn'" in str(caught[0].message)  # what to use instead
        q = torch.randn(1, 2, 8, 16)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)  # torch's CPU kernel, as the warning says
        assert handle.active and cudnn_attention.stats()["provider"]["sdpa_forward"] == 0
    finally:
        handle.remove()


def test_sdp_backend_settings_are_set_while_installed_and_restored():
    cudnn = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    before_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    before_order = _compat.sdp_priority_order()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with cudnn_attention.enabled():
            assert torch.backends.cuda.cudnn_sdp_enabled()
            order = _compat.sdp_priority_order()
            assert order[0] == cudnn and sorted(order) == sorted(before_order)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert _compat.sdp_priority_order() == before_order
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before_enabled)


def test_enabled_removes_on_exit_and_on_exception():
    with cudnn_attention.enabled() as handle:
        assert handle.active and _ours_registered(DENSE_OPS[0])
    assert not handle.active and not _ours_registered(DENSE_OPS[0])
    with pytest.raises(KeyError, match="boom"), cudnn_attention.enabled() as handle:
        raise KeyError("boom")
    assert not handle.active and provider.current() is None
    assert not any(_ours_registered(op) for op in DENSE_OPS + VARLEN_OPS)


def test_enabled_leaves_an_outer_installation_in_place():
    outer = cudnn_attention.install()
    with cudnn_attention.enabled() as inner:
        assert inner is outer
    assert outer.active and provider.current() is outer
    outer.remove()


@pytest.mark.skipif(not hasattr(torch.nn.attention, "register_flash_attention_impl"), reason="torch without the flash-attention registry")
def test_torch_registry_activates_and_restores_the_same_switch():
    attention = torch.nn.attention
    assert provider.register_with_torch() and provider.register_with_torch()  # idempotent
    assert "CUDNN_ATTENTION_PROJECT" in attention.list_flash_attention_impls()
    attention.activate_flash_attention_impl("CUDNN_ATTENTION_PROJECT")
    handle = provider.current()
    assert handle is not None and handle.active and attention.current_flash_attention_impl() == "CUDNN_ATTENTION_PROJECT"
    attention.restore_flash_attention_impl()
    assert not handle.active and provider.current() is None and not _ours_registered(DENSE_OPS[0])
    # A direct remove() also clears the registry's record, so it never names a removed provider.
    attention.activate_flash_attention_impl("CUDNN_ATTENTION_PROJECT")
    provider.current().remove()
    assert attention.current_flash_attention_impl() is None


def test_import_changes_nothing():
    # _compat loaded from its file, so that reading the state does not import the package first.
    code = (
        (
            "import importlib.util, torch; spec = importlib.util.spec_from_file_location('compat', COMPAT);"
            " compat = importlib.util.module_from_spec(spec); spec.loader.exec_module(compat);"
            " state = lambda: ([compat.kernel_registrations(op, key) for op in OPS for key in ('CUDA', 'CPU')],"
            " compat.sdp_priority_order(),"
            " torch.backends.cuda.cudnn_sdp_enabled());"
            " before = state(); import cudnn_attention; after = state(); assert before == after, (before, after);"
            " assert cudnn_attention.provider.current() is None; print('ok')"
        )
        .replace("COMPAT", repr(str(pathlib.Path(_compat.__file__))))
        .replace("OPS", repr(DENSE_OPS))
    )
    assert python_output(code) == "ok"


# ----------------------------------------------------------------------------------------------
# Plumbing on CPU
# ----------------------------------------------------------------------------------------------


def _math_with_bias(q, k, v, bias, scale):
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale + bias.float()
    return torch.softmax(scores, -1).to(v.dtype) @ v, torch.logsumexp(scores, -1, keepdim=True)


def _standin_torch_forward(
    query,
    key,
    value,
    attn_bias,
    cum_q,
    cum_k,
    max_q,
    max_k,
    compute_lse,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    out, lse = _math_with_bias(query, key, value, attn_bias, scale)
    seed = torch.empty((), dtype=torch.long)
    return out, lse, None, None, max_q, max_k, seed, seed.clone(), None


def _standin_torch_backward(
    grad_out, query, key, value, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, *, scale=None
):
    def grads():
        inputs = [t.detach().requires_grad_() for t in (query, key, value)]
        return torch.autograd.grad(_math_with_bias(*inputs, attn_bias, scale)[0], inputs, grad_out)

    return in_fresh_thread(grads)


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The provider's kernels at the CPU key, with CPU stand-ins for the ops they call."""
    monkeypatch.setattr(sdpa_overrides, "lse_has_trailing_one", provider._aten_lse_has_trailing_one())
    aten = torch.library.Library("aten", "IMPL")
    for name, kernel in provider._DENSE_KERNELS.items():
        aten.impl(name, kernel, "CPU")
    aten.impl("_cudnn_attention_forward", _standin_torch_forward, "CPU")
    aten.impl("_cudnn_attention_backward", _standin_torch_backward, "CPU")
    varlen = torch.library.Library("torch_attn", "IMPL")
    for name, kernel in provider._varlen_kernels().items():
        varlen.impl(name, kernel, "CPU")
    with our_ops_on_cpu(monkeypatch):
        yield
    for library in (aten, varlen):
        _compat.destroy_library(library)


def _qkv(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator, dtype=torch.float64).float().requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_dense_op_through_torch_autograd_is_served_and_exact(cpu_kernels, causal):
    q, k, v = _qkv(2, 4, 16, 8)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, is_causal=causal)[:2]
    assert lse.shape == ((2, 4, 16, 1) if sdpa_overrides.lse_has_trailing_one else (2, 4, 16))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    provider_stats = cudnn_attention.stats()["provider"]
    assert provider_stats["sdpa_forward"] == 1 and provider_stats["sdpa_backward"] == 1
    assert provider_stats["torch_forward"] == {} and provider_stats["torch_backward"] == {}


# (module, its limit, the limit lowered, cut, its predicate, q's shape as allocated, whether that is (B, S, H, D) memory)
_PIECES = {
    # 7 rows past a batch limit of 3: three chunks (torch's own cuDNN kernel would fail on such a batch).
    "batch chunks": (batch_chunks, "GRID_LIMIT", 3, "chunks", "grid_limited_on", (7, 2, 16, 8), False, 3),
    # B 2 x S 16 x 4 heads x 8 = 1,024 elements past 1,000: two groups of two heads, in (B, S, H, D) memory as
    # transformers passes it (each group's saved output and LSE go back into the layout its own forward writes).
    "head groups": (head_groups, "ELEMENT_LIMIT", 1000, "groups", "element_limited_on", (2, 16, 4, 8), True, 2),
}


@pytest.mark.parametrize("pieces", list(_PIECES))
def test_a_call_past_a_cudnn_limit_is_served_in_pieces(cpu_kernels, monkeypatch, pieces):
    # The limit lowered on a "device" cuDNN serves: the call goes to our op in pieces, forward and backward, and gives
    # what one call gives, in its layout.
    module, limit, lowered, cut_name, predicate, shape, bshd, count = _PIECES[pieces]
    whole_limit = getattr(errata, limit)
    monkeypatch.setattr(errata, limit, lowered)
    monkeypatch.setattr(module, predicate, lambda device_type: True)
    cut = []
    split = getattr(module, cut_name)
    monkeypatch.setattr(module, cut_name, lambda prepared, n: cut.append(n) or split(prepared, n))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator).half() for _ in range(3))
    q, k, v = ((t.transpose(1, 2) if bshd else t).requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(q.shape, generator=generator).half()

    def run():
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, is_causal=True)[:2]
        return out, lse, torch.autograd.grad(out, (q, k, v), grad_out)

    out, lse, grads = run()
    # Cut once each way, forward and backward, where the pieces are resolved, and launched from those same pieces:
    # packed head groups are copies of q, k and v, which a second cut would make again.
    assert cut == [count] * 2, cut
    monkeypatch.setattr(errata, limit, whole_limit)
    whole_out, whole_lse, whole_grads = run()
    assert cut == [count] * 2
    for got, want in zip((out, lse, *grads), (whole_out, whole_lse, *whole_grads)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert out.stride() == whole_out.stride()
    provider_stats = cudnn_attention.stats()["provider"]
    assert provider_stats["sdpa_forward"] == provider_stats["sdpa_backward"] == 2 and not provider_stats["torch_forward"]


def test_head_groups_that_share_a_kv_head_add_its_gradients(cpu_kernels, monkeypatch):
    # MQA past a lowered element limit (B 2 x S 16 x 4 query heads x 8 = 1,024 past 1,000): two groups of two query
    # heads share the one kv head, and the backward op adds their dK and dV (head_groups.joined_gradients).
    monkeypatch.setattr(errata, "ELEMENT_LIMIT", 1000)
    monkeypatch.setattr(head_groups, "element_limited_on", lambda device_type: True)
    cut, returned = [], []
    split, backward = head_groups.groups, sdpa_overrides._backward
    monkeypatch.setattr(head_groups, "groups", lambda prepared, n: cut.append(n) or split(prepared, n))
    # What the backward op returns, before torch's autograd would sum a gradient of (2, 2, 16, 8) into k's (2, 1, 16, 8).
    monkeypatch.setattr(sdpa_overrides, "_backward", lambda *args: returned.append(backward(*args)) or returned[-1])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, heads, 8, generator=generator).half().transpose(1, 2).requires_grad_() for heads in (4, 1, 1))
    grad_out = torch.randn(q.shape, generator=generator).half()

    def run():
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, is_causal=True)[:2]
        return out, lse, torch.autograd.grad(out, (q, k, v), grad_out)

    out, lse, grads = run()
    assert cut == [2, 2], cut
    assert [tuple(t.shape) for t in returned[0][:3]] == [(2, 4, 16, 8), (2, 1, 16, 8), (2, 1, 16, 8)]
    monkeypatch.setattr(errata, "ELEMENT_LIMIT", 2**31)
    whole_out, whole_lse, whole_grads = run()
    assert cut == [2, 2]
    for got, want in zip((out, lse, grads[0]), (whole_out, whole_lse, whole_grads[0])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(grads[1:], whole_grads[1:]):
        # Each group's dK and dV rounded to float16 by its kernel, then added in float32: within a float16 rounding.
        torch.testing.assert_close(got, want, rtol=0, atol=torch.finfo(torch.float16).eps * want.abs().max().item())


def test_dense_op_without_grad_returns_a_full_size_lse(cpu_kernels):
    q, k, v = (t.detach() for t in _qkv(1, 2, 8, 8))
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)[:2]
    assert lse.numel() == 16 and out.shape == (1, 2, 8, 8)


def test_attention_bias_is_handed_to_torch_and_counted(cpu_kernels):
    q, k, v = _qkv(1, 2, 8, 8)
    bias = torch.randn(1, 2, 8, 8)
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, scale=0.5)[0]
    out.sum().backward()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.5))
    provider_stats = cudnn_attention.stats()["provider"]
    assert provider_stats["torch_forward"] == {"attention bias": 1} and provider_stats["torch_backward"] == {"attention bias": 1}
    assert provider_stats["sdpa_forward"] == provider_stats["sdpa_backward"] == 0


def test_varlen_attn_is_served_with_bottom_right_windows(cpu_kernels):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    # More keys than queries per document (a KV prefix): only then does bottom-right alignment differ from top-left.
    lengths_q, lengths_kv = [3, 6, 2], [5, 9, 2]
    cu_q, cu_kv = (torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32) for lengths in (lengths_q, lengths_kv))
    q = _qkv(sum(lengths_q), 4, 8, seed=1)[0]
    k, v = _qkv(sum(lengths_kv), 4, 8, seed=2)[:2]
    out = varlen.varlen_attn(q, k, v, cu_q, cu_kv, max(lengths_q), max(lengths_kv), window_size=(3, 0))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    # Each document on its own, with the same window: query i sits at key position i + len_kv - len_q (the last
    # len_q keys), and sees itself and the 3 keys before.
    expected, expected_grads = per_document_reference(q, k, v, cu_q, cu_kv, grad_out, left=3)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    provider_stats = cudnn_attention.stats()["provider"]
    assert provider_stats["varlen_forward"] == 1 and provider_stats["varlen_backward"] == 1


def test_varlen_out_variant_writes_out(cpu_kernels):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if not hasattr(varlen, "varlen_attn_out"):
        pytest.skip("torch without varlen_attn_out")
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    q, k, v = (t.detach() for t in _qkv(10, 2, 8, seed=2))
    out = torch.full_like(q, float("nan"))
    _, lse = varlen.varlen_attn_out(out, q, k, v, cu, cu, 6, 6, return_aux=varlen.AuxRequest(lse=True))
    assert torch.isfinite(out).all() and lse.shape == (2, 10)
    torch.testing.assert_close(out, varlen.varlen_attn(q, k, v, cu, cu, 6, 6))
