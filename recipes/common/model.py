"""Models for the recipes: a random-initialized Hugging Face model built from a config, or a local checkpoint.

``import cudnn_attention`` (done here) registers ``attn_implementation="cudnn"`` with transformers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

import cudnn_attention  # noqa: F401  (registers attn_implementation="cudnn" when transformers loads)
from cudnn_attention.integrations.hf._compat import without_hub_kernels

from .config import ModelShape, model_shape
from .errors import RecipeError

__all__ = [
    "MASKED_IMPLEMENTATIONS",
    "UnsupportedImplementation",
    "build_model",
    "hf_config",
    "model_of",
    "packing_safe_masks",
    "training_experts",
]


class UnsupportedImplementation(RecipeError):
    """The model does not support the requested ``attn_implementation`` (transformers refused it)."""


def hf_config(
    *,
    family: str,
    shape: ModelShape,
    vocab_size: int,
    max_positions: int,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
):
    """The transformers config of ``family`` with ``shape`` (no dropout: cuDNN serves dropout-free attention)."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_positions,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        tie_word_embeddings=False,
        use_cache=False,
    )
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=shape.window)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "gpt_oss":
        # Even-numbered layers slide, as in the released gpt-oss; every layer has learnable sinks.
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.layers)]
        # gpt-oss's YaRN RoPE is defined for 131072 positions (32 x 4096); any other value only triggers a warning.
        common["max_position_embeddings"] = max(max_positions, 131072)
        return tf.GptOssConfig(
            **common,
            sliding_window=shape.window,
            layer_types=layer_types,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token,
            output_router_logits=False,
        )
    raise ValueError(f"unknown family {family!r}")


def build_model(
    *,
    attn_implementation: str,
    family: str | None = None,
    shape: ModelShape | None = None,
    vocab_size: int | None = None,
    max_positions: int = 4096,
    checkpoint: str | None = None,
    tokenizer=None,
    device=None,
    dtype=None,
    seed: int = 0,
):
    """A causal LM ready to train: from the local ``checkpoint`` directory, else random-initialized from ``family``/``shape``.

    ``device``/``dtype`` default to torch's current ones (Lightning's init context sets them).
    Raises :class:`UnsupportedImplementation` when the model does not support ``attn_implementation`` (gpt-oss and "sdpa").
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # the same weights for every implementation of a comparison
    if checkpoint is not None:
        if not Path(checkpoint).is_dir():
            # Local directories only: never a hub name (recipes run offline; no surprise downloads).
            raise RecipeError(f"checkpoint directory {checkpoint!r} does not exist: pass a local directory (recipes download nothing)")
        with _refusal_as_unsupported():
            # Without hub kernels: implementations compared must run the same kernels outside attention (see _compat).
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint, attn_implementation=attn_implementation, dtype=dtype, local_files_only=True, **without_hub_kernels()
            )
        if device is not None:
            model = model.to(device)
        config = model.config
    else:
        config = hf_config(
            family=family,
            shape=shape,
            vocab_size=vocab_size,
            max_positions=max_positions,
            pad_token_id=getattr(tokenizer, "pad_token_id", None),
            eos_token_id=getattr(tokenizer, "eos_token_id", None),
            bos_token_id=getattr(tokenizer, "bos_token_id", None),
        )
        with torch.device(device) if device is not None else contextlib.nullcontext(), _refusal_as_unsupported():
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    config.use_cache = False  # training: a cache would also leak across packed documents on eager/sdpa
    if getattr(config, "model_type", None) == "gpt_oss":
        packing_safe_masks(model)
        training_experts(model)
    # from_pretrained returns a model in eval mode; Lightning keeps each module's mode (and warns), so a checkpoint
    # would otherwise train without what train mode turns on (the checkpoint's dropout, for one).
    return model.train()


def model_of(options, *, implementation: str, tokenizer, device, dtype, seed: int):
    """:func:`build_model` from a resolved :class:`~.config.RecipeOptions`: its checkpoint, or its family at its size."""
    return build_model(
        attn_implementation=implementation,
        family=options.family,
        shape=None if options.checkpoint else model_shape(family=options.family, size=options.size),
        vocab_size=tokenizer.vocab_size,
        max_positions=max(4096, options.max_doc_tokens),
        checkpoint=options.checkpoint,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        seed=seed,
    )


@contextlib.contextmanager
def _refusal_as_unsupported():
    # transformers raises a plain ValueError ("... does not support an attention implementation ...");
    # a distinct type lets a comparison skip that implementation without hiding other errors.
    try:
        yield
    except ValueError as error:
        if "does not support" in str(error) and "attention" in str(error):
            raise UnsupportedImplementation(str(error).split(". ")[0]) from error
        raise


def training_experts(model) -> None:
    """Run gpt-oss's experts with transformers' ``"eager"`` loop instead of its default ``"grouped_mm"``.

    grouped_mm gathers a bias row for every (token, expert) pair (``gate_up_proj_bias[expert_ids]``); the
    backward of that gather scatter-adds tens of thousands of rows into a handful of bias rows, which torch
    does with a sort-based kernel that serializes equal indices. On an H200 that kernel took 133 of a 201 ms
    gpt-oss training step (16k tokens, 4 experts, ``benchmarks/end_to_end.py``); the eager loop, which indexes
    the biases once per expert, runs the same step in 68-69 ms with cuDNN (82-85 ms with flex_attention). Same
    math, same parameters: only the order of the sums differs.
    """
    model.set_experts_implementation("eager")


# The implementations that read the attention mask alone; "cudnn" and the flash-style ones read cu_seq_lens_* themselves.
MASKED_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")


def packing_safe_masks(model) -> None:
    """Make eager/sdpa/flex_attention keep packed gpt-oss documents apart.

    transformers' gpt-oss builds its masks without ``position_ids`` (unlike Mistral or Llama), so
    the mask-level packing detection never runs and those implementations attend across document
    boundaries of a ``DataCollatorWithFlattening`` batch. This pre-hook builds the masks the way
    Mistral does, with ``position_ids``, when no mask is given. "cudnn" and flash-style
    implementations read ``cu_seq_lens_*`` themselves and are left alone.
    """
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from cudnn_attention.integrations.hf._compat import attn_implementation_of

    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    def build_masks(module, args, kwargs):
        implementation = attn_implementation_of(module)  # transformers has no public getter (see cudnn_attention.integrations.hf._compat)
        position_ids = kwargs.get("position_ids")
        if implementation not in MASKED_IMPLEMENTATIONS or kwargs.get("attention_mask") is not None or position_ids is None:
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        reference = kwargs.get("inputs_embeds")
        if reference is None:  # the mask builders read only shape, dtype and device
            reference = torch.empty(*input_ids.shape, 0, dtype=module.embed_tokens.weight.dtype, device=input_ids.device)
        # (config, inputs_embeds, attention_mask, cache) by position: 5.24 renamed the cache keyword from past_key_values
        # (the old name warns, and goes in 5.40), and both names sit at the same place in 5.17 to 5.25.
        arguments = (module.config, reference, None, None)
        kwargs["attention_mask"] = {
            "full_attention": create_causal_mask(*arguments, position_ids=position_ids),
            "sliding_attention": create_sliding_window_causal_mask(*arguments, position_ids=position_ids),
        }
        return args, kwargs

    inner.register_forward_pre_hook(build_masks, with_kwargs=True)
