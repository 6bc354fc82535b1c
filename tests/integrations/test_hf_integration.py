"""attn_implementation="cudnn" against "eager" on tiny random models (CPU: the exact fallback path)."""

import pytest
import torch

import cudnn_attention
from cudnn_attention.integrations.hf import _compat
from support.child_process import python_output

transformers = pytest.importorskip("transformers")
from support.hf_models import MODELS, VOCAB, build, documents, packed_batch, padded_batch  # noqa: E402

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
    assert _compat.attn_implementation_of(model) == "cudnn"
    hf.unregister()
    try:
        assert not hf.is_registered()
        with pytest.raises(ValueError):
            build("llama", "cudnn")
    finally:
        hf.register()
    assert hf.is_registered()


def test_import_adds_one_removable_hook_and_imports_no_framework():
    code = """if True:
        import sys
        before = list(sys.meta_path)
        import cudnn_attention
        added = [type(finder).__name__ for finder in sys.meta_path if finder not in before]
        assert added == ["RegisterOnLoad"], added
        frameworks = [m for m in sys.modules if m.split(".")[0] in ("transformers", "lightning", "pytorch_lightning")]
        assert not frameworks and "cudnn_attention.integrations.lightning" not in sys.modules, frameworks
        from cudnn_attention.integrations import hf
        hf.unregister()  # before transformers loads: takes the hook back
        assert sys.meta_path == before
        import transformers.modeling_utils
        assert not hf.is_registered()
        print("ok")
    """
    assert python_output(code) == "ok"


@pytest.mark.parametrize("order", ["cudnn_attention first", "transformers first"])
def test_the_name_is_registered_whichever_is_imported_first(order):
    imports = ["import cudnn_attention", "import transformers.modeling_utils"]
    code = "\n".join(
        [
            "import sys",
            *(imports if order == "cudnn_attention first" else imports[::-1]),
            "from cudnn_attention.integrations import hf",
            "assert not any(type(f).__name__ == 'RegisterOnLoad' for f in sys.meta_path)",  # fired (or never needed)
            "print(hf.is_registered())",
        ]
    )
    assert python_output(code) == "True"


# ----------------------------------------------------------------------------------------------
# switch_to_cudnn / ModelSwitch: models built elsewhere, moved to "cudnn" for a while
# ----------------------------------------------------------------------------------------------


def test_switch_moves_every_model_inside_and_gives_each_its_own_back():
    from cudnn_attention.integrations.hf import ModelSwitch, switch_to_cudnn

    eager, sdpa = build("llama", "eager"), build("mistral", "sdpa")
    holder = torch.nn.ModuleDict({"a": eager, "b": torch.nn.Sequential(sdpa)})
    switch = switch_to_cudnn(holder)
    assert isinstance(switch, ModelSwitch) and switch.models == [eager, sdpa]
    assert _compat.attn_implementation_of(eager) == _compat.attn_implementation_of(sdpa) == "cudnn"
    with torch.no_grad():
        eager(random_ids(1, 5))
    assert cudnn_attention.stats()["fallback_forward"] == {"cpu tensors": 2}  # the "cudnn" function served both layers
    switch.restore()
    assert (_compat.attn_implementation_of(eager), _compat.attn_implementation_of(sdpa)) == ("eager", "sdpa")
    assert switch.models == []
    switch.restore()  # idempotent
    assert _compat.attn_implementation_of(eager) == "eager"


def test_nested_switches_leave_a_model_to_the_switch_that_moved_it():
    from cudnn_attention.integrations.hf import switch_to_cudnn

    model = build("llama", "sdpa")
    with switch_to_cudnn(model) as outer:
        with switch_to_cudnn(model) as inner:
            assert inner.models == [] and outer.models == [model]
        assert _compat.attn_implementation_of(model) == "cudnn"  # the inner switch did not record "cudnn" as previous
    assert _compat.attn_implementation_of(model) == "sdpa"


def test_switch_given_a_trainer_says_to_pass_its_model(tmp_path):
    # It once failed deep inside with "AttributeError: 'Trainer' object has no attribute 'modules'".
    from transformers import Trainer, TrainingArguments

    from cudnn_attention.integrations.hf import ModelSwitch, switch_to_cudnn

    model = build("llama", "eager")
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    expected = r"takes a torch\.nn\.Module .* got a transformers\.trainer\.Trainer: pass its model, switch_to_cudnn\(trainer\.model\)"
    with pytest.raises(TypeError, match=expected):
        switch_to_cudnn(trainer)
    with pytest.raises(TypeError, match=r"got a str: pass"):
        ModelSwitch().apply("meta-llama/Llama-3.2-1B")
    assert _compat.attn_implementation_of(model) == "eager"
    with switch_to_cudnn(trainer.model):
        assert _compat.attn_implementation_of(model) == "cudnn"


def test_switch_with_no_hugging_face_model_inside_says_so():
    import warnings

    from cudnn_attention.integrations.hf import switch_to_cudnn

    with pytest.warns(UserWarning, match=r"no Hugging Face model \(transformers\.PreTrainedModel\) inside the Linear") as caught:
        switch = switch_to_cudnn(torch.nn.Linear(2, 2))
    assert switch.models == [] and caught[0].filename == __file__  # the warning names the caller's line
    model = build("llama", "sdpa")
    with switch_to_cudnn(model), warnings.catch_warnings():
        warnings.simplefilter("error")  # a model held by another switch is no mistake: no warning
        assert switch_to_cudnn(model).models == []


def test_switch_restores_on_error_and_reapplies_after_a_move_in_between():
    from cudnn_attention.integrations.hf import ModelSwitch

    model = build("llama", "eager")
    switch = ModelSwitch()
    with pytest.raises(RuntimeError, match="inside"), switch:
        switch.apply(model)
        model.set_attn_implementation("sdpa")  # someone else moves it
        assert switch.apply(model) == 1 and _compat.attn_implementation_of(model) == "cudnn"
        raise RuntimeError("inside")
    assert _compat.attn_implementation_of(model) == "eager"


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
    else:  # with a mask each layer also computes its last query row on its own (a padded one reads eager's output)
        assert stats["fallback_forward"] == {"cpu tensors": 2 if padding == "none" else 4}, stats


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


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
@pytest.mark.parametrize("inputs", ["position_ids", "flash kwargs", "padding mask"])
def test_a_training_step_leaves_no_tensor_in_a_reference_cycle(name, inputs):
    """A tensor in a reference cycle lives until the cyclic GC's next full pass, possibly steps
    later: on the GPU a cycle left by cuDNN's frontend once held a long-context step's activations
    for two more steps (see ``graph_build._on_a_fresh_stack``). This guards the layers' own code."""
    import gc

    model = build(name, "cudnn").train()
    docs = _documents()
    if inputs == "padding mask":
        batch = padded_batch(docs, pad_to_multiple_of=8)
    else:
        batch = packed_batch(docs, flash_kwargs=inputs == "flash kwargs")

    def step():
        model(**batch, use_cache=False).logits.float().square().mean().backward()

    step()  # the first step fills caches and warns once per reason
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        gc.collect()
        # Real tensors only: fake ones left by other tests' tracing live in FakeTensorMode's own reference cycles (its
        # converter and shape environment), which the collector frees whenever it runs, this step's run included.
        cyclic = [tuple(o.shape) for o in gc.garbage if type(o) in (torch.Tensor, torch.nn.Parameter)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not cyclic, f"tensors of shapes {cyclic} were freed only by the cyclic GC"


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


def test_fallback_warning_names_the_users_line_through_transformers():
    # Through transformers' modeling code the warning once named the package's own attention function.
    import sys

    model = build("llama", "cudnn")
    ids = random_ids(1, 6)
    with torch.no_grad(), pytest.warns(cudnn_attention.CudnnAttentionFallbackWarning, match="cpu tensors") as record:
        line = sys._getframe().f_lineno + 1
        model(ids)
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line)]


def test_the_layer_reads_is_causal_by_its_truth_as_transformers_does():
    # The core refuses a non-bool causal (causal="false" would read as true); transformers reads a module's is_causal, a
    # config's is_decoder say, by its truth, and so does its layer here.
    from cudnn_attention.integrations.hf.attention_function import cudnn_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    outs = []
    for flag in (1, True, 0, False):
        module = type("Attention", (), {"is_causal": flag})()
        outs.append(cudnn_attention_forward(module, q, k, v, None)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(outs[2], outs[3], rtol=0, atol=0)
    assert not torch.equal(outs[0], outs[2])


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
    # A static cache's unwritten slots are told by the written length (a tensor for a static cache), never by zeros in
    # the mask: its slot map has the cache's width, -1 past the written keys, 0 for padding.
    from cudnn_attention.integrations.hf import cudnn_attention_mask

    slots = cudnn_attention_mask(
        batch_size=2, q_length=1, kv_length=8, q_offset=torch.tensor(4), kv_offset=0, attention_mask=None, device="cpu"
    )
    assert slots.dtype == torch.int8 and slots.tolist() == [[1] * 5 + [-1] * 3] * 2
    padding = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    slots = cudnn_attention_mask(batch_size=2, q_length=1, kv_length=8, q_offset=torch.tensor(4), kv_offset=0, attention_mask=padding)
    assert slots.tolist() == [[0, 1, 1, 1, 1, -1, -1, -1], [1, 1, 1, 1, 1, -1, -1, -1]]
    # generate passes that map back into the forward cast to bool (-1 is True there): the same map comes out.
    again = cudnn_attention_mask(batch_size=2, q_length=1, kv_length=8, q_offset=torch.tensor(4), kv_offset=0, attention_mask=slots.bool())
    assert torch.equal(again, slots)
    keep = cudnn_attention_mask(batch_size=2, q_length=1, kv_length=8, q_offset=4, kv_offset=0, attention_mask=padding)
    assert keep.tolist() == padding.tolist()  # a written length known as an int: the keep-mask of the written keys
    assert (
        cudnn_attention_mask(batch_size=2, q_length=5, kv_length=5, q_offset=0, attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None
    )
    trailing = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)  # every row ends with padding: still 5 written keys
    assert cudnn_attention_mask(batch_size=2, q_length=5, kv_length=5, q_offset=0, attention_mask=trailing).shape == (2, 5)


def test_mask_function_traces_without_data_dependent_branches():
    # What compiled decoding with a static cache runs: q_offset a tensor, a padded 2-D mask whose values are unknown.
    from transformers.masking_utils import causal_mask_function

    from cudnn_attention.integrations.hf import cudnn_attention_mask

    def build_mask(attention_mask, q_offset):
        return cudnn_attention_mask(
            batch_size=2,
            q_length=1,
            kv_length=8,
            q_offset=q_offset,
            kv_offset=0,
            mask_function=causal_mask_function,
            attention_mask=attention_mask,
            device="cpu",
        )

    compiled = torch.compile(build_mask, fullgraph=True, backend="eager")
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert compiled(padding, torch.tensor(4)).tolist() == [[0, 1, 1, 1, 1, -1, -1, -1], [1, 1, 1, 1, 1, -1, -1, -1]]
    assert compiled(padding, torch.tensor(5)).tolist() == [[0, 1, 1, 1, 1, 1, -1, -1], [1, 1, 1, 1, 1, 1, -1, -1]]


def compare_with_eager(name, **inputs):
    """(cudnn logits, eager logits) for the same inputs."""
    model = build(name, "eager")
    with torch.no_grad():
        expected = model(**inputs, use_cache=False).logits
        model.set_attn_implementation("cudnn")
        got = model(**inputs, use_cache=False).logits
    return got, expected


@pytest.mark.parametrize("name", MODELS)
def test_trailing_padding_in_every_row(name):
    # padding="max_length" / pad_to_multiple_of: every row ends with padding, which once read as a static cache's unwritten slots.
    ids = random_ids(3, 12, seed=5)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    mask[1, -5:] = 0
    mask[2, -1:] = 0
    got, expected = compare_with_eager(name, input_ids=ids, attention_mask=mask)
    assert_close_rel(got[mask.bool()], expected[mask.bool()], f"{name} trailing padding logits")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_pad_to_multiple_of_collator(name, padding_side):
    batch = padded_batch(documents((5, 9, 3), seed=6), pad_to_multiple_of=8, padding_side=padding_side)
    got, expected = compare_with_eager(name, **batch)
    valid = batch["attention_mask"].bool()
    assert_close_rel(got[valid], expected[valid], f"{name} pad_to_multiple_of logits")


GAP_MASKS = [
    [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],  # what generate builds when it continues a right-padded prompt
    [1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0],  # two gaps and trailing padding
    [0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1],  # left padding and a gap
]


@pytest.mark.parametrize("name", MODELS)
def test_mask_with_a_gap(name):
    ids = random_ids(3, 12, seed=7)
    mask = torch.tensor(GAP_MASKS)
    cudnn_attention.reset_stats()
    got, expected = compare_with_eager(name, input_ids=ids, attention_mask=mask)
    assert_close_rel(got[mask.bool()], expected[mask.bool()], f"{name} gap-mask logits")
    if name in ("mistral", "qwen2", "qwen3", "gemma3", "gpt_oss"):
        # A window over a gap counts absolute positions (eager's rule): the exact eager path serves it, visibly.
        assert cudnn_attention.stats()["fallback_forward"].get("transformers: a sliding window over a padding mask with a gap", 0) >= 1


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_generation_after_right_padding(name, cache_implementation):
    # Right-padded prompts: generate appends tokens after the padding, so later steps see masks with a gap.
    ids = random_ids(2, 7, seed=8)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    ids[0, -3:] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache_implementation)
    model = build(name, "eager")
    with torch.no_grad():
        expected = model.generate(ids, **kwargs, return_dict_in_generate=True, output_logits=True)
        model.set_attn_implementation("cudnn")
        got = model.generate(ids, **kwargs, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        assert_close_rel(a, b, f"{name} step {step} logits")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_compiled_generation_traces_the_hf_layer(name):
    # torch.compile(model.forward, fullgraph=True) under generate with a static cache: the mask function, the HF
    # layer's gathering and the core's exact path must hold no data-dependent branch. (The GPU file runs it on cuDNN.)
    torch._dynamo.reset()
    ids = random_ids(2, 6, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    model = build(name, "eager")
    expected = model.generate(ids, **kwargs)
    model.set_attn_implementation("cudnn")
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    assert torch.equal(model.generate(ids, **kwargs), expected)


def test_compiled_static_cache_decoding_without_a_mask():
    # A compiled forward called directly with a static cache and no mask: the written length is a tensor while
    # tracing, and the mask function's slot map tells the attention function which slots hold keys.
    from transformers import StaticCache

    torch._dynamo.reset()
    ids = random_ids(1, 5, seed=12)
    model = build("llama", "eager")

    with torch.no_grad():
        expected = model(ids).logits
        model.set_attn_implementation("cudnn")
        forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        cache = StaticCache(config=model.config, max_cache_len=16)
        # (input_ids, attention_mask, position_ids, cache) by position: 5.24 renamed past_key_values to cache.
        prefill = forward(ids[:, :4], None, None, cache).logits
        assert cudnn_attention.stats()["fallback_forward"] == {"cpu tensors": 2 * model.config.num_hidden_layers}  # see below
        step = forward(ids[:, 4:], None, None, cache).logits
    assert_close_rel(torch.cat([prefill, step], dim=1), expected, "compiled static-cache logits")
    # The compiled graphs count what they run, per call, as eager does: the prefill's core calls (two per layer: without
    # gradients the HF layer computes the last query row on its own too, see _masked) and the step's (one per layer: a
    # single query). The step once went to the eager-equivalent path on transformers' 4-D mask; none does now.
    fallbacks = cudnn_attention.stats()["fallback_forward"]
    layers = model.config.num_hidden_layers
    assert fallbacks == {"cpu tensors": 3 * layers}, fallbacks


@pytest.mark.parametrize("name", MODELS)
def test_position_ids_not_starting_at_zero(name):
    # [3, 4, 5] continues a document, [0 .. 4] starts one: every token attends (eager's rule), none reads zero.
    ids = random_ids(1, 8, seed=10)
    position_ids = torch.tensor([[3, 4, 5, 0, 1, 2, 3, 4]])
    model = build(name, "cudnn")
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=False).logits[0]
        model.set_attn_implementation("eager")
        alone = torch.cat([model(ids[:, a:b], position_ids=position_ids[:, a:b], use_cache=False).logits[0] for a, b in ((0, 3), (3, 8))])
    assert_close_rel(packed, alone, f"{name} logits")


BAD_PACKING = [
    ({"cu_seq_lens_q": [0, 3, 7]}, r"cu_seq_lens_q\[-1\] = 7 leaves tokens 7..7 of the 8 in no document"),
    ({"cu_seq_lens_k": [0, 3, 5]}, r"cu_seq_lens_k\[-1\] = 5 leaves tokens 5..7 of the 8 in no document"),
    ({"max_length_q": 3}, "a document in cu_seq_lens_q has 5 tokens, more than max_length_q 3"),
    ({"max_length_k": 4}, "a document in cu_seq_lens_k has 5 tokens, more than max_length_k 4"),
    ({"cu_seq_lens_q": [0, 5, 3, 8]}, "cu_seq_lens_q must be non-decreasing"),
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("bad, message", BAD_PACKING)
def test_bad_packing_metadata_is_refused(name, bad, message):
    batch = packed_batch(documents((3, 5), seed=11))
    for key, value in bad.items():
        batch[key] = torch.tensor(value, dtype=torch.int32) if key.startswith("cu") else value
    if "cu_seq_lens_q" in bad and len(bad["cu_seq_lens_q"]) != len(batch["cu_seq_lens_k"]):
        batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"]
    model = build(name, "cudnn")
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(**batch, use_cache=False)


@pytest.fixture
def no_attention_runs(monkeypatch):
    """Fails the test if any attention is computed (cuDNN, the core's exact path or the model's eager one): the
    input errors below must come first."""
    from cudnn_attention import api
    from cudnn_attention.integrations.hf import attention_function

    def reached(*args, **kwargs):
        raise AssertionError("attention was computed before the input error")

    monkeypatch.setattr(api, "serve", reached)
    monkeypatch.setattr(attention_function, "eager_equivalent", reached)


BAD_FLASH_KWARGS = [
    ({"max_length_k": -1}, ValueError, r"max_length_k must be >= 0, got -1"),
    ({"max_length_k": None}, ValueError, r"cu_seq_lens_q, cu_seq_lens_k, max_length_q and max_length_k go together.* without max_length_k"),
    ({"cu_seq_lens_k": None, "max_length_k": None}, ValueError, r"go together.* without cu_seq_lens_k, max_length_k"),
    ({"cu_seq_lens_q": torch.tensor([0.0, 3.0, 8.0])}, TypeError, r"cu_seq_lens_q must be int32 or int64, got torch.float32"),
    (
        {"cu_seq_lens_q": torch.tensor([0, 3, 5, 8], dtype=torch.int32)},
        ValueError,
        r"cu_seq_lens_q and cu_seq_lens_k describe different batch sizes: 3 and 2",
    ),
    (
        {"cu_seq_lens_k": torch.tensor([[0, 3, 8]], dtype=torch.int32)},
        ValueError,
        r"cu_seq_lens_k must be 1-D with B \+ 1 >= 2 entries, got shape \(1, 3\)",
    ),
]


def _kwargs_id(bad: dict) -> str:
    return ",".join(f"{k}={list(v.shape) if isinstance(v, torch.Tensor) else v}" for k, v in bad.items())


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # gemma2: the eager fallback (softcapping) reads the documents too
@pytest.mark.parametrize("bad, error, message", BAD_FLASH_KWARGS, ids=[_kwargs_id(bad) for bad, _, _ in BAD_FLASH_KWARGS])
def test_bad_flash_kwargs_are_refused_before_any_attention(name, bad, error, message, no_attention_runs):
    batch = packed_batch(documents((3, 5), seed=11))
    batch.update(bad)
    model = build(name, "cudnn")
    with torch.no_grad(), pytest.raises(error, match=message):
        model(**batch, use_cache=False)


def _past_then(model, ids, past: int, mask_width: int):
    """A forward of ``ids[:, past:]`` after a cached prefill of ``ids[:, :past]``, with a 2-D mask of ``mask_width`` columns."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # (input_ids, attention_mask, position_ids, cache) by position: 5.24 renamed past_key_values to cache.
    with torch.no_grad():
        model(ids[:, :past], torch.ones(ids.shape[0], past, dtype=torch.long), None, cache)
    return model(ids[:, past:], torch.ones(ids.shape[0], mask_width, dtype=torch.long), None, cache)


def _padded_ones(batch, width, padded=2):
    mask = torch.ones(batch, width, dtype=torch.long)
    mask[0, :padded] = 0
    return mask


SHORT_MASKS = {
    # The user's report: input_ids (2, 11), mask (2, 8) with the default cache. The queries were read as the last 11 of 8
    # keys: an out-of-bounds gather (CPU: "INDICES element is out of DATA bounds", CUDA: CUBLAS_STATUS_INTERNAL_ERROR).
    "with a cache": (
        lambda model, ids: model(ids, attention_mask=torch.ones(2, 8, dtype=torch.long)),
        r"attention_mask has 8 columns, but the keys number 11 \(0 cached \+ 11 new\)",
    ),
    # Without a cache transformers takes the key count from the mask itself; the attention function sees the 11 queries.
    "padded, no cache": (
        lambda model, ids: model(ids, attention_mask=_padded_ones(2, 8), use_cache=False),
        r"attention_mask has 8 columns \(keys\), fewer than the 11 new tokens",
    ),
    # Once served without a word: the 5 new tokens were read as keys 0..4 and attended to nothing after them.
    "after a prefill": (
        lambda model, ids: _past_then(model, ids, 6, 5),
        r"attention_mask has 5 columns, but the keys number 11 \(6 cached \+ 5 new\)",
    ),
    "one short after a prefill": (
        lambda model, ids: _past_then(model, ids, 6, 10),
        r"attention_mask has 10 columns, but the keys number 11 \(6 cached \+ 5 new\)",
    ),
}


@pytest.mark.parametrize("name", ["llama", "mistral"])
@pytest.mark.parametrize("case", SHORT_MASKS)
def test_a_2d_mask_shorter_than_the_keys_is_refused(name, case):
    call, message = SHORT_MASKS[case]
    model = build(name, "cudnn")
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        call(model, random_ids(2, 11, seed=13))


def test_a_2d_mask_covering_past_and_new_keys_is_served():
    # The same calls at the widths transformers expects, against eager (the refusals above are no blanket rule).
    ids = random_ids(2, 11, seed=13)
    got, expected = [], []
    for impl, out in (("cudnn", got), ("eager", expected)):
        model = build("llama", impl)
        with torch.no_grad():
            out.append(model(ids, attention_mask=torch.ones(2, 11, dtype=torch.long)).logits)
            out.append(_past_then(model, ids, 6, 11).logits)
    for a, b in zip(got, expected):
        assert_close_rel(a, b, "logits")


BAD_MASKS = [
    (torch.ones(1, 11, dtype=torch.long), ValueError, r"attention_mask has 1 rows for a batch of 2"),
    (torch.ones(2, 11, 11, dtype=torch.bool), ValueError, r"attention_mask must be 2-D \(batch, keys\) or 4-D .*got shape \(2, 11, 11\)"),
    # 4-D masks go to the model's eager attention as they are; a wrong shape there broke only after the scores were computed.
    (
        torch.ones(2, 1, 11, 9, dtype=torch.bool),
        ValueError,
        r"4-D attention_mask must have shape \(1 or 2, 1 or 4, 1 or 11, 11\).* got \(2, 1, 11, 9\)",
    ),
    (torch.zeros(1, 1, 11, 13), ValueError, r"4-D attention_mask must have shape \(1 or 2, 1 or 4, 1 or 11, 11\).* got \(1, 1, 11, 13\)"),
    (torch.ones(2, 3, 11, 11, dtype=torch.bool), ValueError, r"got \(2, 3, 11, 11\)"),
    (torch.ones(3, 1, 11, 11, dtype=torch.bool), ValueError, r"got \(3, 1, 11, 11\)"),
    # An integer 0/1 keep-mask was added to the scores as it was (+1 where kept): no masking at all, without a word.
    (torch.ones(2, 1, 11, 11, dtype=torch.long).tril(), TypeError, r"4-D attention_mask must be bool .* or floating .*, got torch.int64"),
]


@pytest.mark.parametrize("mask, error, message", BAD_MASKS, ids=[f"{tuple(m.shape)} {str(m.dtype)[6:]}" for m, _, _ in BAD_MASKS])
def test_a_mask_of_the_wrong_shape_is_refused_before_any_attention(mask, error, message, no_attention_runs):
    model = build("llama", "cudnn")
    with torch.no_grad(), pytest.raises(error, match=message):
        model(random_ids(2, 11), attention_mask=mask, use_cache=False)


@pytest.mark.parametrize("shape", [(2, 1, 11, 11), (1, 4, 11, 11), (2, 1, 1, 11)])
def test_a_broadcastable_4d_mask_is_served_like_eager(shape):
    keep = torch.ones(shape, dtype=torch.bool).tril() if shape[2] > 1 else torch.ones(shape, dtype=torch.bool)
    keep[..., 0] = True
    keep[0, ..., 1] = False
    additive = torch.zeros(shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    got, expected = compare_with_eager("llama", input_ids=random_ids(2, 11), attention_mask=additive)
    assert_close_rel(got, expected, f"{shape} logits")


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


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_a_static_max_length_above_the_batch_is_an_upper_bound(name):
    # CUDA-graph and compile users pass one static max_length for every batch, as FlashAttention accepts.
    model = build(name, "cudnn")
    batch = packed_batch(documents((3, 5), seed=11))
    with torch.no_grad():
        tight = model(**batch, use_cache=False).logits
        loose = model(**{**batch, "max_length_q": 4096, "max_length_k": 2**40}, use_cache=False).logits
    torch.testing.assert_close(loose, tight, rtol=1e-5, atol=1e-5)  # fp32 rounding apart: the sums' order follows the bound
