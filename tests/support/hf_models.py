"""Tiny random transformers models built from configs (no downloads), shared by the HF tests."""

import torch

VOCAB = 96


def build(name: str, attn_implementation: str = "eager", dtype=torch.float32, device="cpu", head_dim=16, moe_top_k=2):
    """head_dim 16 keeps CPU tests fast; GPU tests use 64, a size cuDNN's kernels serve.

    ``moe_top_k``: gpt-oss routes each token to its top-k experts; in bf16 a near tie flips the
    choice under any rounding difference and moves logits by far more than the rounding itself,
    so bf16 comparisons route to every expert (k = 4), which keeps routing continuous."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    if name == "llama":
        config = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif name == "mistral":
        config = tf.MistralConfig(**common, sliding_window=4)
        cls = tf.MistralForCausalLM
    elif name == "qwen2":
        # Layer 0 full attention, layer 1 sliding.
        config = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        cls = tf.Qwen2ForCausalLM
    elif name == "qwen3":
        # Layer 0 full attention, layer 1 sliding (q/k norms and an explicit head_dim besides).
        config = tf.Qwen3Config(**common, head_dim=head_dim, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        cls = tf.Qwen3ForCausalLM
    elif name == "gemma2":
        config = tf.Gemma2Config(
            **common,
            head_dim=head_dim,
            sliding_window=4,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=head_dim,
        )
        cls = tf.Gemma2ForCausalLM
    elif name == "gemma3":
        # Text-only Gemma 3: no softcapping (so cuDNN serves it), sliding then full attention.
        config = tf.Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            sliding_window=4,
            query_pre_attn_scalar=head_dim,
            layer_types=["sliding_attention", "full_attention"],
        )
        cls = tf.Gemma3ForCausalLM
    elif name == "gpt_oss":
        config = tf.GptOssConfig(
            **common,
            head_dim=head_dim,
            sliding_window=4,
            num_local_experts=4,
            num_experts_per_tok=moe_top_k,
            layer_types=["sliding_attention", "full_attention"],
        )
        cls = tf.GptOssForCausalLM
    else:
        raise ValueError(name)
    torch.manual_seed(0)
    model = cls(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_()  # zero-initialized sinks would hide sink bugs
    model.set_attn_implementation(attn_implementation)
    return model.eval()


MODELS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss"]


def documents(lengths, *, seed: int) -> list[list[int]]:
    """Random token documents of the given lengths (ids 3 and up: 0-2 are the special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def prompt_batches(count: int, *, rows: int, length: int, padding: bool, seed: int, device="cpu") -> list[dict]:
    """``count`` prompt batches (``input_ids``, ``attention_mask``) of the same shape and different tokens, for
    ``generate``; with ``padding``, the last row of each left-padded by ``length // 3`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
        mask = torch.ones_like(ids)
        if padding:
            mask[-1, : length // 3] = 0
            ids[-1, : length // 3] = 0
        batches.append({"input_ids": ids.to(device), "attention_mask": mask.to(device)})
    return batches


def packed_batch(docs, *, flash_kwargs: bool = True, device="cpu", with_labels: bool = False) -> dict:
    """``docs`` packed into one row by transformers' ``DataCollatorWithFlattening``, on ``device``."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": d} for d in docs])
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if with_labels or k != "labels"}


def padded_batch(docs, *, pad_to_multiple_of: int, padding_side: str = "right", device="cpu") -> dict:
    """``docs`` padded by transformers' ``DataCollatorWithPadding(pad_to_multiple_of=...)`` with a word-level
    tokenizer built in memory (token i is the word "i"; pad id 0), so every row can end with padding."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({str(i): i for i in range(VOCAB)}, unk_token="3")), pad_token="0", padding_side=padding_side
    )
    batch = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt")([{"input_ids": d} for d in docs])
    return {k: v.to(device) for k, v in batch.items()}
