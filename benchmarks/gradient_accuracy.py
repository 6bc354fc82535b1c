"""How far each attention implementation's parameter gradients are from fp32 on the recipes' own packed batches: the
accuracy of one step, which the loss curves (``recipe_training.py --suite loss``) show only after training has
amplified it into trajectories of their own.

    python3 benchmarks/gradient_accuracy.py --out benchmarks/results   # small preset, 4096-token packs, Mistral-like and gpt-oss-like
    python3 benchmarks/gradient_accuracy.py --quick                    # the plumbing on a CPU: tiny preset, the exact fallback

Each implementation runs the recipe's model with bf16 weights (as the Lightning recipe's ``bf16-true``) on the same
packs and initial weights; each parameter's gradient is compared with eager's in fp32 by whole-tensor relative error.
Eager in bf16 is the yardstick: the error bf16 itself brings. gpt-oss routes every token to every expert here, since
top-2 routing flips on bf16 near-ties, a discontinuity that has nothing to do with attention. ``flash_attention_4`` (FlashAttention's
CuTe kernels, learnable-sink backward included) is measured where it is installed and reported as skipped elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from cudnn_attention.recipes.common import (
    STATS_KEY,
    PackedCollator,
    UnsupportedImplementation,
    build_dataset,
    build_model,
    data_budget,
    load_tokenizer,
    model_shape,
    skip_reason,
)

__all__ = ["parameter_gradients", "recipe_batches", "recipe_gradients", "relative_error"]

ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTATIONS = ("cudnn", "sdpa", "flex_attention", "flash_attention_4", "eager")
REFERENCE = ("eager", torch.float32)


def relative_error(got: torch.Tensor, fp32_ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| over the whole tensor (``||got||`` when the reference is zero)."""
    scale = fp32_ref.float().norm().item()
    return (got.float() - fp32_ref.float()).norm().item() / scale if scale > 0 else got.float().norm().item()


def parameter_gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float() for name, p in model.named_parameters() if p.grad is not None}


def recipe_batches(*, size: str, tokens: int, count: int, device: str) -> list[dict]:
    """The first ``count`` packs of the recipes' default data (offline corpus, byte tokenizer), collated for one step each."""
    tokenizer = load_tokenizer()
    budget = data_budget(size=size, tokens_per_step=tokens)
    dataset = build_dataset(tokenizer=tokenizer, dataset=None, text_field="text", tokens_per_step=tokens, min_doc_tokens=budget.min_doc_tokens,
                            max_doc_tokens=budget.max_doc_tokens, seed=0)  # fmt: skip
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
                model = build_model(attn_implementation=implementation, family=family, shape=shape, vocab_size=tokenizer.vocab_size,
                                    max_positions=max(4096, budget.max_doc_tokens), tokenizer=tokenizer, device=device, dtype=dtype, seed=0)  # fmt: skip
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


def _summary(errors: dict[str, list[float]], eager_bf16: dict[str, list[float]]) -> dict:
    """Over every (pack, parameter): the median and largest relative error, and the median and largest ratio to eager bf16's
    error on the same parameter and pack; the same medians over the attention projections alone."""
    flat = [e for values in errors.values() for e in values]
    ratios = [e / max(b, 1e-12) for name in errors for e, b in zip(errors[name], eager_bf16[name], strict=True)]
    attention = [e for name, values in errors.items() if ".self_attn." in name for e in values]
    return {
        "median_error": statistics.median(flat),
        "max_error": max(flat),
        "median_ratio_to_eager_bf16": statistics.median(ratios),
        "max_ratio_to_eager_bf16": max(ratios),
        "attention_median_error": statistics.median(attention) if attention else None,
        "worst_parameter": max(errors, key=lambda name: max(errors[name])),
    }


def measure(*, family: str, size: str, tokens: int, packs: int, device: str) -> dict:
    """Relative gradient errors of every implementation against eager fp32 over ``packs`` recipe batches, summarized."""
    implementations = [REFERENCE] + [(name, torch.bfloat16) for name in IMPLEMENTATIONS]
    errors: dict[str, dict[str, list[float]]] = {}
    skipped: dict[str, str] = {}
    for batch in recipe_batches(size=size, tokens=tokens, count=packs, device=device):
        grads = recipe_gradients(family=family, size=size, batch=batch, implementations=implementations, device=device)
        reference = grads.pop(REFERENCE)
        for (implementation, _), found in grads.items():
            if isinstance(found, str):
                skipped[implementation] = found
                continue
            per_parameter = errors.setdefault(implementation, {})
            for name, want in reference.items():
                per_parameter.setdefault(name, []).append(relative_error(found[name], want))
    eager_bf16 = errors["eager"]
    return {
        "family": family, "size": size, "tokens": tokens, "packs": packs,
        "implementations": {name: _summary(values, eager_bf16) for name, values in errors.items()},
        "skipped": skipped,
        "errors": errors,
    }  # fmt: skip


def report(results: list[dict], *, header: str) -> str:
    explained = ("Relative error of each parameter's whole gradient against eager in fp32 (same weights and packs), over every "
                 "(pack, parameter); the ratio divides by eager bf16's error on the same parameter and pack.")  # fmt: skip
    columns = ("| model | packs x tokens | implementation | median error | max error | median ratio to eager bf16 | max ratio | "
               "attention projections: median error | worst parameter |")  # fmt: skip
    lines = ["# Gradient accuracy on the recipes' packed batches", "", header, "", explained, "", columns, "|---|" * 1 + "---|" * 8]
    for result in results:
        where = f"{result['packs']} x {result['tokens']}"
        for name, s in result["implementations"].items():
            attention = "-" if s["attention_median_error"] is None else f"{s['attention_median_error']:.3g}"
            lines.append(f"| {result['family']} | {where} | {name} | {s['median_error']:.3g} | {s['max_error']:.3g} | "
                         f"{s['median_ratio_to_eager_bf16']:.2f} | {s['max_ratio_to_eager_bf16']:.2f} | {attention} | {s['worst_parameter']} |")  # fmt: skip
        for name, reason in result["skipped"].items():
            lines.append(f"| {result['family']} | {where} | {name} | {reason} | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["mistral", "gpt_oss"])
    parser.add_argument("--packs", type=int, default=3, help="packed batches per model")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per pack (eager materializes each document's scores)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks")
    parser.add_argument("--quick", action="store_true", help="tiny preset, one 512-token pack: check the plumbing (CPU)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick:
        # The small preset's bf16 gradients on a CPU would take hours and measure the fallback, not cuDNN.
        parser.error("this machine has no GPU: on a CPU pass --quick (tiny preset, one pack: the plumbing on the exact fallback)")
    size, tokens, packs = ("tiny", 512, 1) if args.quick else ("small", args.tokens, args.packs)
    import cudnn_attention

    start = time.perf_counter()
    results = [measure(family=family, size=size, tokens=tokens, packs=packs, device=device) for family in args.families]
    stats = cudnn_attention.stats()
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    header = (f"Measured on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, in {time.perf_counter() - start:.0f} s; "
              f"cudnn served by cuDNN {stats['cudnn_backward']} backward calls, fallback {stats['fallback_backward'] or 'none'}.")  # fmt: skip
    text = report(results, header=header)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gradient_accuracy.md").write_text(text)
    (args.out / "gradient_accuracy.json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    return results


if __name__ == "__main__":
    main()
