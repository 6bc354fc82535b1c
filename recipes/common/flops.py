"""Model FLOPs of a packed training step, for MFU: 6 x active matmul parameters x tokens, plus attention.

Attention counts the (query, key) pairs each document actually computes — causal counts half the
square (the convention of FlashAttention's benchmarks), a window of W keys at most W per query — times
``4 * H_q * D`` for the two matmuls forward, times 3 for forward plus backward (the backward counted as twice
the forward, as in the 6 x parameters x tokens rule for the other matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepFlops", "causal_pairs", "step_flops_of"]


def causal_pairs(length: int, *, window: int | None) -> int:
    """Visible (query, key) pairs of one causal document; ``window`` = keys per query including itself (transformers' W)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


@dataclass(frozen=True, kw_only=True)
class StepFlops:
    """What a step's FLOPs depend on, read once from a model."""

    matmul_params: float  # per token, experts weighted by the share each token uses
    attention_width: int  # H_q * head_dim
    layer_windows: tuple  # one window (or None) per layer

    def __call__(self, doc_lengths: list[int]) -> tuple[float, float]:
        """``(total, attention)`` training FLOPs of one step over documents of ``doc_lengths``."""
        tokens = sum(doc_lengths)
        attention = 0.0
        for window in self.layer_windows:
            attention += 12.0 * self.attention_width * sum(causal_pairs(n, window=window) for n in doc_lengths)
        return 6.0 * self.matmul_params * tokens + attention, attention


def step_flops_of(model: torch.nn.Module) -> StepFlops:
    """Read :class:`StepFlops` from a Hugging Face causal LM (random or loaded)."""
    config = model.config
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    experts, per_token = getattr(config, "num_local_experts", 0) or 0, getattr(config, "num_experts_per_tok", 0) or 0
    matmul = 0.0
    for name, parameter in model.named_parameters():
        if parameter is embedding or parameter.dim() < 2:  # a lookup, norms, biases, sinks: no matmul
            continue
        share = per_token / experts if experts and ".experts." in name else 1.0
        matmul += parameter.numel() * share
    if output is not None and output.weight is embedding:  # tied: the LM head is a matmul all the same
        matmul += embedding.numel()
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return StepFlops(matmul_params=matmul, attention_width=config.num_attention_heads * head_dim, layer_windows=windows)
