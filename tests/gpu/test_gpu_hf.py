"""attn_implementation="cudnn" on a GPU: cuDNN serves every layer, within bf16 noise of eager."""

import itertools

import pytest
import torch

import cudnn_attention

transformers = pytest.importorskip("transformers")
from support.child_process import run_python  # noqa: E402
from support.compile_counting import counting_backend  # noqa: E402
from support.hf_models import MODELS, VOCAB, build, documents, packed_batch, padded_batch, prompt_batches  # noqa: E402
from support.model_gradients import gradient_mismatches, parameter_gradients  # noqa: E402
from support.tolerances import assert_within_lowp_noise, lowp_noise_bound  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def gpu_model(name, impl, dtype=torch.bfloat16):
    return build(name, impl, dtype=dtype, device=DEVICE, head_dim=64, moe_top_k=4)


def _within_noise_of_eager(name, what, valid=None, **inputs):
    """The logits of ``name`` on ``inputs`` (passed as given) on cuDNN in bf16, within bf16 noise of eager in fp32 (at
    ``valid`` positions); the stats then count the cuDNN model's calls alone."""
    with torch.no_grad():
        ref = gpu_model(name, "eager", torch.float32)(**inputs).logits
        eager = gpu_model(name, "eager")(**inputs).logits
        cudnn_attention.reset_stats()
        got = gpu_model(name, "cudnn")(**inputs).logits
    if valid is not None:
        ref, eager, got = ref[valid], eager[valid], got[valid]
    assert_within_lowp_noise(f"{name} {what}", got, ref, eager)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("padding", ["none", "left"])
def test_models_run_on_cudnn_within_bf16_noise(name, padding):
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 150), device=DEVICE)
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :37] = 0
    _within_noise_of_eager(name, padding, valid=mask.bool(), input_ids=ids, attention_mask=mask)
    stats = cudnn_attention.stats()
    if name == "gemma2":  # softcapping: the eager-equivalent path, visibly
        assert stats["fallback_forward"] == {"transformers: logit softcapping": 2}
    else:
        # With a mask each layer also computes its last query row on its own (a padded one reads eager's output).
        assert stats["cudnn_forward"] == (2 if padding == "none" else 4) and not stats["fallback_forward"], stats


def _docs(seed):
    return documents((130, 1, 77, 200), seed=seed)


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
@pytest.mark.parametrize("flash_kwargs", [True, False])
def test_packed_documents_do_not_leak_through_the_model(name, flash_kwargs):
    model = gpu_model(name, "cudnn")
    docs = _docs(1)
    with torch.no_grad():
        base = model(**packed_batch(docs, flash_kwargs=flash_kwargs, device=DEVICE), use_cache=False).logits[0]
        changed = [list(reversed(docs[0]))] + docs[1:]
        other = model(**packed_batch(changed, flash_kwargs=flash_kwargs, device=DEVICE), use_cache=False).logits[0]
    first = len(docs[0])
    assert not torch.equal(base[:first], other[:first])
    assert torch.equal(base[first:], other[first:]), "documents after the first changed when only the first did"
    assert cudnn_attention.stats()["cudnn_forward"] >= 4


def test_gpt_oss_sink_gradients_match_eager():
    docs = _docs(2)[:3]
    grads = {}
    for impl, dtype in (("cudnn", torch.bfloat16), ("eager", torch.float32), ("eager", torch.bfloat16)):
        model = gpu_model("gpt_oss", impl, dtype).train()
        model.config.router_aux_loss_coef = 0.0
        total = 0
        for doc in docs:  # eager leaks across packed documents, so compare document by document
            ids = torch.tensor([doc], device=DEVICE)
            total = total + model(ids, labels=ids, use_cache=False).loss.float()
        total.backward()
        grads[impl, dtype] = torch.cat([m.sinks.grad.float().flatten() for m in model.modules() if hasattr(m, "sinks")])
    assert grads["cudnn", torch.bfloat16].abs().max() > 0
    assert_within_lowp_noise("d sinks", grads["cudnn", torch.bfloat16], grads["eager", torch.float32], grads["eager", torch.bfloat16])


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
def test_packed_training_gradients_match_eager_for_every_parameter(name):
    # One packed step against eager run document by document (eager would attend across packed documents):
    # every parameter's gradient within bf16 noise. Loss curves only show a wrong gradient after many steps,
    # and blurred by training noise; gpt-oss's head-major q once got a wrong dQ that this catches at once.
    docs = _docs(3)
    starts = [0, *itertools.accumulate(len(doc) for doc in docs)]

    def summed_loss(logits_SV, ids):  # next-token cross-entropy inside one document, summed
        return torch.nn.functional.cross_entropy(
            logits_SV[:-1].float(), torch.tensor(ids[1:], dtype=torch.long, device=DEVICE), reduction="sum"
        )

    grads = {}
    for impl, dtype in (("cudnn", torch.bfloat16), ("eager", torch.float32), ("eager", torch.bfloat16)):
        model = gpu_model(name, impl, dtype).train()
        if impl == "cudnn":
            logits = model(**packed_batch(docs, device=DEVICE), use_cache=False).logits[0]
            total = sum(summed_loss(logits[a:b], doc) for a, b, doc in zip(starts, starts[1:], docs))
        else:
            total = sum(summed_loss(model(torch.tensor([doc], device=DEVICE), use_cache=False).logits[0], doc) for doc in docs)
        total.backward()
        grads[impl, dtype] = parameter_gradients(model)
    mismatches = gradient_mismatches(grads["cudnn", torch.bfloat16], grads["eager", torch.float32], grads["eager", torch.bfloat16])
    assert not mismatches, "\n".join(mismatches)


def test_trainer_step_runs_on_cudnn(tmp_path):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model = gpu_model("qwen2", "cudnn", torch.float32)
    docs = _docs(3) * 2
    dataset = [{"input_ids": d} for d in docs]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        bf16=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
    )
    cudnn_attention.reset_stats()
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    )
    result = trainer.train()
    stats = cudnn_attention.stats()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert stats["cudnn_forward"] >= 4 and stats["cudnn_backward"] >= 4 and not stats["fallback_forward"], stats


def _masks(kind: str) -> torch.Tensor:
    mask = torch.ones(3, 150, dtype=torch.long)
    if kind == "trailing":  # every row ends with padding (padding="max_length"): never a static cache's unwritten slots
        mask[0, -10:] = 0
        mask[1, -37:] = 0
        mask[2, -1:] = 0
    elif kind == "gap":  # padding between real tokens (generate continuing a right-padded prompt), with left/right padding too
        mask[0, 60:63] = 0
        mask[1, 20:21] = 0
        mask[1, -5:] = 0
        mask[2, :7] = 0
        mask[2, 100:140] = 0
    return mask.to(DEVICE)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["trailing", "gap"])
def test_padding_patterns_within_bf16_noise(name, kind):
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 150), device=DEVICE)
    mask = _masks(kind)
    _within_noise_of_eager(name, kind, valid=mask.bool(), input_ids=ids, attention_mask=mask, use_cache=False)
    stats = cudnn_attention.stats()
    # Every layer is served: on cuDNN, or (visibly) on the exact eager path for what cuDNN cannot express here.
    exact_reasons = {"transformers: logit softcapping", "transformers: a sliding window over a padding mask with a gap"}
    assert stats["cudnn_forward"] + sum(stats["fallback_forward"].values()) >= 2 and set(stats["fallback_forward"]) <= exact_reasons, stats
    if kind == "gap" and name == "llama":  # no sliding layer: the gap is gathered away on cuDNN
        assert stats["cudnn_forward"] >= 2 and not stats["fallback_forward"], stats


@pytest.mark.parametrize("name", MODELS)
def test_pad_to_multiple_of_collator_within_bf16_noise(name):
    batch = padded_batch(documents((70, 130, 9), seed=4), pad_to_multiple_of=64, device=DEVICE)
    _within_noise_of_eager(name, "pad_to_multiple_of", valid=batch["attention_mask"].bool(), **batch, use_cache=False)


@pytest.mark.parametrize("name", MODELS)
def test_position_ids_not_starting_at_zero_within_bf16_noise(name):
    # Tokens 0-99 continue a document (positions 37..136), tokens 100-179 start one: every token attends, none reads zero.
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (1, 180), device=DEVICE)
    position_ids = torch.cat([torch.arange(37, 137), torch.arange(80)]).view(1, -1).to(DEVICE)
    logits = {}
    for impl, dtype in (("cudnn", torch.bfloat16), ("eager", torch.float32), ("eager", torch.bfloat16)):
        model = gpu_model(name, impl, dtype)
        with torch.no_grad():
            if impl == "cudnn":
                logits[impl, dtype] = model(ids, position_ids=position_ids, use_cache=False).logits[0]
            else:  # eager document by document is the ground truth
                logits[impl, dtype] = torch.cat(
                    [model(ids[:, a:b], position_ids=position_ids[:, a:b], use_cache=False).logits[0] for a, b in ((0, 100), (100, 180))]
                )
    assert_within_lowp_noise(
        f"{name} position_ids", logits["cudnn", torch.bfloat16], logits["eager", torch.float32], logits["eager", torch.bfloat16]
    )


def assert_greedy_within_bf16_noise(what, got, eager, ref, prompt_len):
    """Greedy generations (``generate(..., return_dict_in_generate=True, output_logits=True)``) of cuDNN in bf16 (``got``),
    eager in bf16 (``eager``) and eager in fp32 (``ref``). While the three share a context, each step's logits must sit
    within bf16 noise of fp32 (the suite's rule); a token that differs from eager's is accepted only where eager's own
    bf16 logits are a near tie (the two tokens' margin within that noise), after which the contexts differ and the
    comparison ends. Exact token equality would fail on any near tie, whichever kernel is right."""
    for step, (got_logits, eager_logits, ref_logits) in enumerate(zip(got.logits, eager.logits, ref.logits)):
        context = prompt_len + step
        if not (
            torch.equal(got.sequences[:, :context], eager.sequences[:, :context])
            and torch.equal(eager.sequences[:, :context], ref.sequences[:, :context])
        ):
            break
        assert_within_lowp_noise(f"{what} step {step} logits", got_logits, ref_logits.float(), eager_logits)
        got_tokens, eager_tokens = got.sequences[:, context], eager.sequences[:, context]
        if not torch.equal(got_tokens, eager_tokens):
            noise = lowp_noise_bound(ref_logits, eager_logits)
            rows = (got_tokens != eager_tokens).nonzero().view(-1)
            margin = eager_logits.float()[rows, eager_tokens[rows]] - eager_logits.float()[rows, got_tokens[rows]]
            assert (margin <= noise).all(), (
                f"{what} step {step}: token {got_tokens[rows].tolist()} instead of {eager_tokens[rows].tolist()}, "
                f"margin {margin.tolist()} > noise {noise:.3g}"
            )
            break
    else:
        assert torch.equal(got.sequences, eager.sequences), what


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_generation_after_right_padding_matches_eager(name, cache_implementation):
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 40), device=DEVICE)
    mask = torch.ones_like(ids)
    # Fewer pads than the tiny models' window (4): a padded last position whose whole window is padding reads zero
    # here (FlashAttention's convention) while eager's additive mask averages every value in the cache there.
    mask[0, -3:] = 0
    ids[0, -3:] = 0
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        cache_implementation=cache_implementation,
        return_dict_in_generate=True,
        output_logits=True,
    )
    runs = {
        (impl, dtype): gpu_model(name, impl, dtype).generate(ids, **kwargs)
        for impl, dtype in (("cudnn", torch.bfloat16), ("eager", torch.bfloat16), ("eager", torch.float32))
    }
    assert_greedy_within_bf16_noise(
        f"{name} {cache_implementation}",
        runs["cudnn", torch.bfloat16],
        runs["eager", torch.bfloat16],
        runs["eager", torch.float32],
        ids.shape[1],
    )


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_oss"])
def test_compiled_generation_fullgraph_matches_eager(name):
    torch._dynamo.reset()
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (2, 24), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = gpu_model(name, "eager").generate(ids, **kwargs)
    model = gpu_model(name, "cudnn")
    model.forward = torch.compile(model.forward, fullgraph=True)
    assert torch.equal(model.generate(ids, **kwargs), expected)


@pytest.mark.parametrize("padding", [False, True])
def test_compiled_generate_with_a_static_cache_compiles_once_on_cudnn(padding):
    # transformers' own test_generate_compile_model_forward_fullgraph on cuDNN: CompileConfig(fullgraph=True,
    # dynamic=False) compiles the decode forward once and replays it for every step of two generations, each step
    # served by cuDNN (strict: any fallback raises), with the tokens of the uncompiled run.
    from transformers import CompileConfig

    torch._dynamo.reset()
    batches = prompt_batches(2, rows=2, length=24, padding=padding, seed=5, device=DEVICE)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    model = gpu_model("llama", "cudnn")
    expected = [model.generate(**batch, **kwargs) for batch in batches]
    backend, graphs = counting_backend()
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    cudnn_attention.reset_stats()
    with cudnn_attention.strict():
        got = [model.generate(**batch, **kwargs, compile_config=compile_config) for batch in batches]
    for run, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"generation {run}: compiled {a.tolist()} against uncompiled {b.tolist()}"
    assert len(graphs) == 1, f"the decode forward was compiled {len(graphs)} times over 2 x 5 steps"
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] > 0 and not stats["fallback_forward"], stats


_BAD_PACKING_ON_DEVICE = """
import sys, torch
sys.path.insert(0, {tests!r})
import cudnn_attention
from support.hf_models import build, documents, packed_batch
model = build("llama", "cudnn", dtype=torch.bfloat16, device="cuda", head_dim=64)
batch = packed_batch(documents((30, 50), seed=0), device="cuda")
batch.update({update})
with torch.no_grad():
    model(**batch, use_cache=False)
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.parametrize(
    "update", ['{"cu_seq_lens_q": torch.tensor([0, 30, 70], dtype=torch.int32, device="cuda")}', '{"max_length_k": 40}']
)
def test_bad_packing_metadata_fails_on_the_device(update):
    # CUDA metadata is checked on the device (no sync): a failed torch._assert_async poisons the CUDA context, so run it apart.
    import os

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, for `support`
    code = _BAD_PACKING_ON_DEVICE.format(tests=tests, update=update)
    result = run_python(code, timeout=None)
    assert result.returncode != 0 and "no error" not in result.stdout, result.stdout + result.stderr
    assert "assert" in result.stderr.lower(), result.stderr[-2000:]
