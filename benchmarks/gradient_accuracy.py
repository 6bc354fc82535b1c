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
import json
import statistics
import time
from pathlib import Path

import torch

from cudnn_attention.recipes.common.gradients import recipe_batches, recipe_gradients, relative_error

__all__ = ["main", "measure", "report"]

ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTATIONS = ("cudnn", "sdpa", "flex_attention", "flash_attention_4", "eager")
REFERENCE = ("eager", torch.float32)


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
        "family": family,
        "size": size,
        "tokens": tokens,
        "packs": packs,
        "implementations": {name: _summary(values, eager_bf16) for name, values in errors.items()},
        "skipped": skipped,
        "errors": errors,
    }


def report(results: list[dict], *, header: str) -> str:
    explained = (
        "Relative error of each parameter's whole gradient against eager in fp32 (same weights and packs), over every "
        "(pack, parameter); the ratio divides by eager bf16's error on the same parameter and pack."
    )
    columns = (
        "| model | packs x tokens | implementation | median error | max error | median ratio to eager bf16 | max ratio | "
        "attention projections: median error | worst parameter |"
    )
    lines = ["# Gradient accuracy on the recipes' packed batches", "", header, "", explained, "", columns, "|---|" * 1 + "---|" * 8]
    for result in results:
        where = f"{result['packs']} x {result['tokens']}"
        for name, s in result["implementations"].items():
            attention = "-" if s["attention_median_error"] is None else f"{s['attention_median_error']:.3g}"
            lines.append(
                f"| {result['family']} | {where} | {name} | {s['median_error']:.3g} | {s['max_error']:.3g} | "
                f"{s['median_ratio_to_eager_bf16']:.2f} | {s['max_ratio_to_eager_bf16']:.2f} | {attention} | {s['worst_parameter']} |"
            )
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
    header = (
        f"Measured on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, in {time.perf_counter() - start:.0f} s; "
        f"cudnn served by cuDNN {stats['cudnn_backward']} backward calls, fallback {stats['fallback_backward'] or 'none'}."
    )
    text = report(results, header=header)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gradient_accuracy.md").write_text(text)
    (args.out / "gradient_accuracy.json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    return results


if __name__ == "__main__":
    main()
