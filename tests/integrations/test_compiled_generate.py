"""A compiled ``generate`` with a static cache compiles its forward once and replays it (CPU: the exact path).

What transformers' own ``test_generate_compile_model_forward_fullgraph`` checks, on the project's tiny models:
``CompileConfig(fullgraph=True, dynamic=False)`` errors out on a new shape, so any input whose shape or Python value
changes between decode steps compiles the forward again. tests/gpu/test_gpu_hf.py runs the same on cuDNN.
"""

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")
from support.compile_counting import counting_backend  # noqa: E402
from support.hf_models import build, prompt_batches  # noqa: E402

NEW_TOKENS = 5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Dynamo's compile state (fake tensors, shape environments) lives in reference cycles that a later test's cyclic GC
    # would meet: test_hf_integration.py's reference-cycle check saw them, now and then, as its own.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()


def _generate(model, batch, **kwargs):
    return model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, cache_implementation="static", **kwargs)


@pytest.mark.parametrize("padding", [False, True])
def test_compiled_generate_with_a_static_cache_compiles_once(padding):
    from transformers import CompileConfig

    batches = prompt_batches(2, rows=2, length=7, padding=padding, seed=11)
    model = build("llama", "eager")
    expected = [_generate(model, batch) for batch in batches]
    model.set_attn_implementation("cudnn")
    backend, graphs = counting_backend()
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    compile_config._compile_all_devices = True  # transformers compiles on a GPU only unless told (its own test does the same)
    for batch, want in zip(batches, expected):
        got = _generate(model, batch, compile_config=compile_config)
        assert torch.equal(got, want), "compiled cudnn generation differs from eager"
    # The prefill runs uncompiled; the 2 x (NEW_TOKENS - 1) decode steps all replay the first step's graph.
    assert len(graphs) == 1, f"the decode forward was compiled {len(graphs)} times over {2 * (NEW_TOKENS - 1)} steps"
