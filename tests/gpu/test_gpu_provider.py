"""The provider on a GPU: F.scaled_dot_product_attention and varlen on this project's ops, and bf16 Lightning fits.

Tolerance rule as in test_gpu_cudnn.py: the error against an fp32 reference (torch's math backend
here) may be at most twice the error of the same math done in bf16, plus 1e-3 of the magnitude.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cudnn_attention
from cudnn_attention import cudnn_graphs, errata, head_groups, provider
from cudnn_attention.masking import MaskSpec
from cudnn_attention.reference import dense_reference, varlen_reference
from support.tolerances import assert_within_lowp_noise

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
B, H, S, D = 2, 8, 256, 64


def _dense_inputs(seed=0):
    torch.manual_seed(seed)  # before allocating, so every run sees the same data
    q, k, v = (torch.randn(B, H, S, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(B, H, S, D, device=DEVICE, dtype=torch.bfloat16)


def _served(stats):
    return {key: stats["provider"][key] for key in ("sdpa_forward", "sdpa_backward", "varlen_forward", "varlen_backward")}


def _references(q, k, v, grad_out, causal):
    """(fp32 out and grads from torch's math backend, the same math in bf16 from the project's reference)."""
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*fp32, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, fp32, grad_out.float())
    bf16 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lowp, _ = dense_reference(*bf16, scale=D**-0.5, mask=MaskSpec(-1, 0 if causal else -1, False), compute_dtype=torch.bfloat16)
    return (ref, ref_grads), (lowp, torch.autograd.grad(lowp, bf16, grad_out))


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_runs_on_our_op_and_matches_math_backend(causal):
    q, k, v, grad_out = _dense_inputs()
    cudnn_attention.reset_stats()
    with cudnn_attention.enabled(), cudnn_attention.strict():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    stats = cudnn_attention.stats()
    assert stats["provider"]["sdpa_forward"] == 1 and stats["provider"]["sdpa_backward"] == 1, stats
    assert stats["cudnn_forward"] == 1 and stats["cudnn_backward"] == 1, stats
    assert not stats["provider"]["torch_forward"] and not stats["provider"]["torch_backward"], stats
    (ref, ref_grads), (lowp, lowp_grads) = _references(q, k, v, grad_out, causal)
    assert_within_lowp_noise("out", out, ref, lowp)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_within_lowp_noise(name, got, want, base)

    # Removed: torch's own cuDNN kernel again; nothing of ours counts.
    cudnn_attention.reset_stats()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        again = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(again, (q, k, v), grad_out)
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] == stats["cudnn_backward"] == 0 and not any(_served(stats).values()), stats
    assert_within_lowp_noise("torch's cuDNN out", again, ref, lowp)


def test_plain_sdpa_call_reaches_cudnn_only_while_enabled():
    # No sdpa_kernel(...) around the call: the backend priority set by install() is what routes it.
    q, k, v, _ = _dense_inputs()
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert cudnn_attention.stats()["provider"]["sdpa_forward"] == 0
        with cudnn_attention.enabled():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert cudnn_attention.stats()["provider"]["sdpa_forward"] == 1
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert cudnn_attention.stats()["provider"]["sdpa_forward"] == 1


def test_attention_bias_keeps_torchs_kernel():
    q, k, v, grad_out = _dense_inputs()
    bias = torch.randn(B, H, S, S, device=DEVICE, dtype=torch.bfloat16)
    with cudnn_attention.enabled():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        torch.autograd.grad(out, (q, k, v), grad_out)
    stats = cudnn_attention.stats()["provider"]
    assert stats["sdpa_forward"] == stats["sdpa_backward"] == 0, stats  # never served with a bias
    if stats["torch_forward"]:  # this torch's cuDNN backend took the biased call: it ran torch's kernel
        assert stats["torch_forward"] == {"attention bias": 1} and stats["torch_backward"] == {"attention bias": 1}, stats
    with sdpa_kernel([SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_served_calls_do_not_synchronize():
    q, k, v, grad_out = _dense_inputs()
    with cudnn_attention.enabled():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad_out)  # builds the graphs
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad_out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert cudnn_attention.stats()["provider"]["sdpa_forward"] == 2


def test_compiled_sdpa_runs_on_our_op():
    # The compiled graph plans with torch's meta kernel; ours must return what it promises.
    q, k, v, grad_out = _dense_inputs()
    with cudnn_attention.enabled():
        compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), fullgraph=True)
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        eager = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        eager_grads = torch.autograd.grad(eager, (q, k, v), grad_out)
    stats = cudnn_attention.stats()["provider"]
    assert stats["sdpa_forward"] == 2 and stats["sdpa_backward"] == 2, stats
    torch.testing.assert_close(out, eager)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want)


def _dense_op_in_pieces(shape, launches, *, kv_heads=None):
    """The provider's dense op, causal and strict, on bf16 data of ``shape`` (k and v with ``kv_heads`` heads, by default
    q's): one provider call each way, served in ``launches`` cuDNN launches each way, within the rule against an fp32
    reference."""
    torch.manual_seed(0)
    kv_shape = (shape[0], kv_heads or shape[1], *shape[2:])
    q, k, v = (torch.randn(size, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for size in (shape, kv_shape, kv_shape))
    grad_out = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    cudnn_attention.reset_stats()
    with cudnn_attention.enabled(), cudnn_attention.strict():
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, is_causal=True)[0]
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    stats = cudnn_attention.stats()
    assert stats["provider"]["sdpa_forward"] == stats["provider"]["sdpa_backward"] == 1, stats
    assert stats["cudnn_forward"] == stats["cudnn_backward"] == launches, stats
    mask, scale = MaskSpec(-1, 0, False), shape[-1] ** -0.5
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = dense_reference(*fp32, scale=scale, mask=mask)
    ref_grads = torch.autograd.grad(ref, fp32, grad_out.float())
    bf16 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lowp, _ = dense_reference(*bf16, scale=scale, mask=mask, compute_dtype=torch.bfloat16)
    lowp_grads = torch.autograd.grad(lowp, bf16, grad_out)
    assert_within_lowp_noise("out", out, ref, lowp)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_within_lowp_noise(name, got, want, base)


def test_a_batch_past_the_grid_limit_is_served_in_chunks():
    # torch's own cuDNN kernel fails at a batch of 65,536 (errata entry batch-or-heads-over-65535); the provider's op
    # serves it as two chunks that fit, forward and backward, within the rule.
    _dense_op_in_pieces((65536, 2, 16, 32), launches=2)


@pytest.mark.parametrize("kv_heads", [8, 1], ids=["MHA", "MQA"])
def test_a_backward_past_the_element_limit_is_served_in_head_groups(monkeypatch, kv_heads):
    # Entry backward-past-2**31-elements with its limit lowered to 40,000 (the real one is test_gpu_large_offsets.py's):
    # B 2 x S 128 x 8 heads x 64 = 131,072 elements, 4 groups of 2 heads (32,768) fit; MQA's four share the one kv head,
    # whose dK and dV the backward op adds up. Graphs and verdicts built under the lowered limit are forgotten after, or a
    # refusal kept would send other tests' calls to the exact path.
    monkeypatch.setattr(errata, "ELEMENT_LIMIT", 40_000)
    monkeypatch.setattr(head_groups, "element_limited_on", lambda device_type: True)
    cudnn_graphs.clear_cache()
    try:
        _dense_op_in_pieces((2, 8, 128, 64), launches=4, kv_heads=kv_heads)
    finally:
        cudnn_graphs.clear_cache()


@pytest.mark.parametrize("route", ["op, causal", "varlen_attn"])
def test_varlen_op_runs_on_our_op_and_matches_reference(route):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if not hasattr(torch.ops.torch_attn, "_varlen_attn"):
        pytest.skip("torch without torch_attn::_varlen_attn")
    lengths = [100, 37, 256, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), H, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    cudnn_attention.reset_stats()
    with cudnn_attention.enabled():
        if route == "varlen_attn":
            # The public function, which passes the op every argument of this release's schema
            # (2.15's backend too): the kernels' binding by schema, as this torch calls them.
            out = varlen.varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths))
        else:
            # The op behind torch.nn.attention.varlen.varlen_attn (positional: its public signature varies by release).
            out = torch.ops.torch_attn._varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), True)[0]
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    stats = cudnn_attention.stats()
    assert stats["provider"]["varlen_forward"] == 1 and stats["provider"]["varlen_backward"] == 1, stats
    assert not stats["provider"]["torch_forward"] and not stats["provider"]["torch_backward"], stats
    mask = MaskSpec(-1, 0 if route == "op, causal" else -1, False)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref, _ = varlen_reference(*leaves, cu, cu, max(lengths), max(lengths), scale=D**-0.5, mask=mask, compute_dtype=dtype)
        results[dtype] = (ref, torch.autograd.grad(ref, leaves, grad_out.to(dtype)))
    (ref, ref_grads), (lowp, lowp_grads) = results[torch.float32], results[torch.bfloat16]
    assert_within_lowp_noise("varlen out", out, ref, lowp)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_within_lowp_noise(f"varlen {name}", got, want, base)


def test_the_frontends_provider_serves_until_replaced_and_again_after_remove():
    # What tests/test_provider_conflicts.py checks in the dispatcher's records, seen in who runs the call.
    upstream = pytest.importorskip("cudnn.torch")
    q, k, v, _ = _dense_inputs()

    def upstream_forwards():
        with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            before = upstream.calls["fwd"]
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return upstream.calls["fwd"] - before

    theirs = upstream.install_sdpa_overrides()
    try:
        assert upstream_forwards() == 1
        with pytest.raises(provider.ProviderConflictError, match="cudnn.torch"):
            cudnn_attention.install()
        with pytest.warns(provider.ProviderConflictWarning, match="cudnn.torch"):
            handle = cudnn_attention.install(replace_existing=True)
        cudnn_attention.reset_stats()
        assert upstream_forwards() == 0 and cudnn_attention.stats()["provider"]["sdpa_forward"] == 1
        handle.remove()
        assert upstream_forwards() == 1 and cudnn_attention.stats()["provider"]["sdpa_forward"] == 1
    finally:
        theirs.remove()


# ----------------------------------------------------------------------------------------------
# Lightning
# ----------------------------------------------------------------------------------------------

LAYERS, STEPS = 3, 3


def _gpu_trainer(tmp_path, callbacks, logger=False):
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=STEPS,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )


def _model(kv_heads=2):
    from support.lightning_models import TinyLlamaModule

    class WithFlops(TinyLlamaModule):
        @property
        def flops_per_batch(self):
            # 6 FLOPs per parameter per token (forward + backward), a standard estimate.
            return 6 * sum(p.numel() for p in self.parameters()) * self.batch_size * self.seq_len

    return WithFlops(hidden=256, layers=LAYERS, heads=4, kv_heads=kv_heads, vocab=128, seq_len=128, batch_size=2)


def test_lightning_bf16_fit_runs_every_layer_on_cudnn_and_reports_mfu(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from lightning.pytorch.loggers import CSVLogger

    from cudnn_attention.integrations.lightning import CudnnAttention, CudnnThroughputMonitor
    from cudnn_attention.integrations.throughput import dense_bf16_peak_flops

    model = _model()
    monitor = CudnnThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], length_fn=lambda batch: batch[0].numel(), window_size=2)
    logger = CSVLogger(tmp_path)
    cudnn_attention.reset_stats()
    _gpu_trainer(tmp_path, [CudnnAttention(strict=True), monitor], logger=logger).fit(model)
    stats = cudnn_attention.stats()
    assert model.seen_implementations == ["cudnn"] * STEPS and model.seen_provider == [True] * STEPS
    assert stats["cudnn_forward"] == LAYERS * STEPS and stats["cudnn_backward"] == LAYERS * STEPS, stats
    assert not stats["fallback_forward"] and not stats["fallback_backward"], stats
    assert model.hf.config._attn_implementation == "sdpa" and provider.current() is None
    if dense_bf16_peak_flops() is not None:  # an H100/H200/A100: MFU is reported
        logger.experiment.save()
        header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
        assert "train/device/mfu" in header and "train/device/items_per_sec" in header, header


def test_lightning_bf16_fit_serves_hf_sdpa_through_the_provider(tmp_path):
    # hf_models=False: the model keeps "sdpa", and its F.scaled_dot_product_attention calls reach
    # the provider. Equal head counts: whether torch's cuDNN backend takes GQA is version dependent.
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from cudnn_attention.integrations.lightning import CudnnAttention

    model = _model(kv_heads=4)
    cudnn_attention.reset_stats()
    _gpu_trainer(tmp_path, [CudnnAttention(hf_models=False)]).fit(model)
    stats = cudnn_attention.stats()
    assert model.seen_implementations == ["sdpa"] * STEPS
    assert stats["provider"]["sdpa_forward"] == LAYERS * STEPS and stats["provider"]["sdpa_backward"] == LAYERS * STEPS, stats
    assert not stats["provider"]["torch_forward"], stats
