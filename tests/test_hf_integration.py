"""attn_implementation="cudnn" against "eager" on tiny random models (CPU: the exact fallback path)."""

import pytest
import torch

import cudnn_attention

transformers = pytest.importorskip("transformers")
from hf_models import MODELS, VOCAB, build, documents, packed_batch  # noqa: E402

RTOL = 1e-4  # fp32 against fp32: summation order only


def assert_close_rel(actual, expected, what):
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual - expected).abs().max()
    assert err <= RTOL * scale, f"{what}: max error {err:.3g} > {RTOL} x {scale:.3g}"


def random_ids(batch, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def test_registration_makes_the_name_available():
    from cudnn_attention.integrations import hf

    assert hf.is_registered()
    model = build("llama", "cudnn")
    assert model.config._attn_implementation == "cudnn"
    hf.unregister()
    try:
        assert not hf.is_registered()
        with pytest.raises(ValueError):
            build("llama", "cudnn")
    finally:
        hf.register()
    assert hf.is_registered()


def test_import_does_not_import_transformers():
    import subprocess
    import sys

    code = "import cudnn_attention, sys; assert 'transformers' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "ok"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_match_eager(name, padding):
    model = build(name, "eager")
    ids = random_ids(3, 11)
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[0, :4] = 0
        mask[2, :1] = 0
    elif padding == "right":
        mask[0, -4:] = 0
        mask[1, -2:] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("cudnn")
        cudnn_attention.reset_stats()
        got = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert_close_rel(got[valid], expected[valid], f"{name} {padding} logits")
    stats = cudnn_attention.stats()
    if name == "gemma2":
        assert stats["fallback_forward"].get("transformers: logit softcapping") == 2, stats
    else:
        assert stats["fallback_forward"] == {"cpu tensors": 2}, stats


def _documents(seed=1):
    return documents((7, 1, 10, 5), seed=seed)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_packed_batch_equals_documents_alone(name, flash_kwargs):
    model = build(name, "cudnn")
    docs = _documents()
    batch = packed_batch(docs, flash_kwargs=flash_kwargs)
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        model.set_attn_implementation("eager")  # eager per document is the ground truth
        alone = torch.cat([model(torch.tensor([d]), use_cache=False).logits[0] for d in docs])
    assert_close_rel(packed, alone, f"{name} packed logits")


def _sum_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("name", MODELS)
def test_packed_gradients_equal_sum_of_document_gradients(name):
    docs = _documents(seed=2)
    batch = packed_batch(docs, with_labels=True)
    model = build(name, "cudnn").train()
    if name == "gpt_oss":
        model.config.router_aux_loss_coef = 0.0
    labels = batch.pop("labels")
    _sum_loss(model(**batch, use_cache=False).logits, labels).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.set_attn_implementation("eager")
    for doc in docs:
        ids = torch.tensor([doc])
        doc_labels = ids.clone()
        doc_labels[0, 0] = -100
        _sum_loss(model(ids, use_cache=False).logits, doc_labels).backward()
    if name == "gpt_oss":
        assert any("sinks" in n for n in packed_grads), "the sinks must receive a gradient"
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert_close_rel(packed_grads[n], p.grad, f"{name} d{n}")


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_on_left_padded_batch(name):
    model = build(name, "eager")
    ids = random_ids(2, 6, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    model.set_attn_implementation("cudnn")
    got = model.generate(ids, **kwargs)
    assert torch.equal(got, expected)


def test_static_cache_generation_matches_eager():
    model = build("llama", "eager")
    ids = random_ids(2, 5, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(ids, **kwargs)
    model.set_attn_implementation("cudnn")
    assert torch.equal(model.generate(ids, **kwargs), expected)


def test_output_attentions_goes_to_the_eager_path_visibly():
    model = build("llama", "cudnn")
    ids = random_ids(1, 6)
    cudnn_attention.reset_stats()
    with pytest.warns(cudnn_attention.CudnnAttentionFallbackWarning, match="output_attentions"):
        out = model(ids, output_attentions=True)
    assert out.attentions is not None and out.attentions[0].shape == (1, 4, 6, 6)
    with cudnn_attention.strict(), pytest.raises(cudnn_attention.StrictModeError, match="output_attentions"):
        model(ids, output_attentions=True)


def test_mask_function_limits_static_cache_keys():
    from cudnn_attention.integrations.hf import cudnn_attention_mask

    keep = cudnn_attention_mask(batch_size=2, q_length=1, kv_length=8, q_offset=torch.tensor(4), kv_offset=0, attention_mask=None, device="cpu")
    assert keep.shape == (2, 8) and keep[:, :5].all() and not keep[:, 5:].any()
    padding = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    keep = cudnn_attention_mask(batch_size=2, q_length=1, kv_length=8, q_offset=4, kv_offset=0, attention_mask=padding)
    assert keep.tolist()[0] == [False, True, True, True, True, False, False, False]
    assert cudnn_attention_mask(batch_size=2, q_length=5, kv_length=5, q_offset=0, attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None


def test_autocast_float32_query_is_cast_like_flash():
    from cudnn_attention.integrations.hf.attention_function import _to_compute_dtype

    q32 = torch.randn(1, 2, 3, 8)
    v16 = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    q, k, v = _to_compute_dtype(q32, q32, v16)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(t.dtype == torch.bfloat16 for t in _to_compute_dtype(q32, q32, q32))
    assert all(t.dtype == torch.float32 for t in _to_compute_dtype(q32, q32, q32))


def test_eager_fallback_counts_the_backward_when_only_the_sinks_learn():
    # gpt-oss's sinks are a parameter of their own: training only them still runs the fallback's backward.
    model = build("gpt_oss", "cudnn")
    model.config.attention_dropout = 0.1  # what cuDNN here cannot express: transformers' eager attention serves it
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.endswith("sinks"))
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    cudnn_attention.reset_stats()
    model.train()(ids, labels=ids).loss.backward()
    reason = "transformers: attention dropout in training"
    assert cudnn_attention.stats()["fallback_backward"] == {reason: 2}, cudnn_attention.stats()
    assert all(layer.self_attn.sinks.grad is not None for layer in model.model.layers)
