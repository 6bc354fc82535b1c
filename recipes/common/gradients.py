"""One training step's parameter gradients on the recipes' own packed batches, per attention implementation, and the
relative error that compares them: what ``benchmarks/gradient_accuracy.py`` measures and the GPU tests check."""

from __future__ import annotations

import dataclasses
import gc

import torch

from .compare import skip_reason
from .config import data_budget, model_shape
from .data import STATS_KEY, PackedCollator, build_dataset
from .model import UnsupportedImplementation, build_model
from .tokenizer import load_tokenizer

__all__ = ["parameter_gradients", "recipe_batches", "recipe_gradients", "relative_error"]


def relative_error(got: torch.Tensor, fp32_ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| over the whole tensor (``||got||`` when the reference is zero)."""
    scale = fp32_ref.float().norm().item()
    return (got.float() - fp32_ref.float()).norm().item() / scale if scale > 0 else got.float().norm().item()


def parameter_gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after a backward, detached, in fp32."""
    return {name: p.grad.detach().float() for name, p in model.named_parameters() if p.grad is not None}


def recipe_batches(*, size: str, tokens: int, count: int, device: str) -> list[dict]:
    """The first ``count`` packs of the recipes' default data (offline corpus, byte tokenizer), collated for one step each."""
    tokenizer = load_tokenizer()
    budget = data_budget(size=size, tokens_per_step=tokens)
    dataset = build_dataset(
        tokenizer=tokenizer,
        dataset=None,
        text_field="text",
        tokens_per_step=tokens,
        min_doc_tokens=budget.min_doc_tokens,
        max_doc_tokens=budget.max_doc_tokens,
        seed=0,
    )
    batches = []
    for index in range(count):
        batch = PackedCollator()([dataset[index]])
        batch.pop(STATS_KEY)
        batches.append({key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()})
    return batches


def recipe_gradients(*, family: str, size: str, batch: dict, implementations, device: str) -> dict:
    """``{(implementation, dtype): {parameter: gradient}}`` of one packed batch from the same initial weights, or
    ``{(implementation, dtype): "skipped: <reason>"}`` for what cannot run here."""
    tokenizer = load_tokenizer()
    budget = data_budget(size=size)
    shape = model_shape(family=family, size=size)
    if shape.experts:
        shape = dataclasses.replace(shape, experts_per_token=shape.experts)
    grads = {}
    for implementation, dtype in implementations:
        reason = skip_reason(implementation, device=device)
        if reason is None:
            try:
                model = build_model(
                    attn_implementation=implementation,
                    family=family,
                    shape=shape,
                    vocab_size=tokenizer.vocab_size,
                    max_positions=max(4096, budget.max_doc_tokens),
                    tokenizer=tokenizer,
                    device=device,
                    dtype=dtype,
                    seed=0,
                )
            except UnsupportedImplementation as error:
                reason = str(error)
        if reason is not None:
            grads[implementation, dtype] = f"skipped: {reason}"
            continue
        model.train()(**batch).loss.backward()
        grads[implementation, dtype] = parameter_gradients(model)
        del model
        gc.collect()
    return grads
