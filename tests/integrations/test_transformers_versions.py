"""What changes between the transformers releases the package supports (5.17 to 5.25): our code calls them warning-free,
and with the same kernels outside attention for every implementation it compares.

CI runs the whole CPU suite on the floor and on the newest releases (.ci/run); these tests pin down the
calls that differ between them.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cudnn_attention.recipes.common import ByteTokenizer, build_model, model_shape  # noqa: E402


def test_gpt_oss_packing_masks_build_without_a_deprecation_warning():
    # 5.24 renamed the mask builders' past_key_values keyword to cache (the old name warns, and goes in 5.40);
    # the recipe's gpt-oss hook passes it by position, which both names accept.
    model = build_model(
        attn_implementation="eager", family="gpt_oss", shape=model_shape(family="gpt_oss", size="tiny"), vocab_size=ByteTokenizer.vocab_size
    )
    ids = torch.arange(3, 15).view(1, -1)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        model(ids, position_ids=position_ids)


def test_recipe_and_doctor_checkpoints_load_without_hub_kernels(tmp_path):
    # transformers 5.25's from_pretrained turns hub kernels on by default (use_kernels=True): on a GPU with the Hub reachable,
    # RMSNorm, rotary and activation layers would come from the Hub for some loads and not others. The recipes (and the
    # benchmarks, which build their models with them) and the doctor's model check keep them off.
    from cudnn_attention.integrations.hf.doctor_model import load_model

    shape = model_shape(family="llama", size="tiny")
    build_model(attn_implementation="eager", family="llama", shape=shape, vocab_size=ByteTokenizer.vocab_size).save_pretrained(tmp_path)
    for implementation in ("cudnn", "sdpa", "eager"):
        model = build_model(attn_implementation=implementation, checkpoint=str(tmp_path))
        assert not model.use_kernels, implementation
    model, _ = load_model(str(tmp_path), device="cpu")
    assert not model.use_kernels


def test_hub_kernel_layers_leave_the_attention_path_unchanged():
    # What hub kernels replace (transformers' use_kernel_forward_from_hub layers) is never the attention function: with a
    # stand-in kernel for every RMSNorm (the Hub's have no CPU build), the layers still call "cudnn", and the logits are
    # the same.
    kernels = pytest.importorskip("kernels")
    from transformers.utils import is_kernels_available

    import cudnn_attention
    from support.hf_models import build

    if not is_kernels_available():
        pytest.skip(f"this transformers does not take kernels {kernels.__version__}")
    calls = []

    class StandInRMSNorm(torch.nn.Module):  # the forward of transformers' LlamaRMSNorm, counted
        def forward(self, hidden_states):
            calls.append(hidden_states.shape)
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class StandInRepository:  # what kernels' mappings hold: something whose load() gives the layer
        def load(self):
            return StandInRMSNorm

    model = build("llama", "cudnn")
    ids = torch.arange(3, 23).view(2, 10)
    with torch.no_grad():
        expected = model(ids).logits
    with kernels.use_kernel_mapping({"RMSNorm": {"cpu": StandInRepository()}}, inherit_mapping=False):
        kernels.kernelize(model, device="cpu", mode=kernels.Mode.INFERENCE)
    cudnn_attention.reset_stats()
    with torch.no_grad():
        got = model(ids).logits
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * layers + 1  # every RMSNorm ran the stand-in: two per layer and the final one
    assert cudnn_attention.stats()["fallback_forward"] == {"cpu tensors": layers}  # every attention call still "cudnn"'s
    assert torch.equal(got, expected)
