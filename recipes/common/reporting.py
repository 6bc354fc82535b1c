"""What a run measured (:class:`RunResult`), its summary, and the files a recipe leaves: metrics JSON and a loss-curve PNG.

Throughput excludes the first steps (graph builds, compilation, allocator warm-up); MFU uses the
GPU's dense bf16 peak from :mod:`cudnn_attention.integrations.throughput` (Lightning's table lacks the H200).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cudnn_attention.environment import versions

from .data import warn_if_repeated
from .run_dirs import RESULTS

__all__ = [
    "IMPLEMENTATION_COLORS",
    "RunResult",
    "announce_run",
    "comparison",
    "describe_comparison",
    "draw_losses",
    "fallback_announced",
    "fallback_reasons",
    "finish",
    "format_mfu",
    "format_rate",
    "header",
    "plot_losses",
    "rates",
    "served_by",
    "step_columns",
    "step_row",
    "warmup_steps",
    "write_metrics",
]

_GIB = 2**30
# One colour per implementation in every panel and every plot of the recipes and their benchmarks.
IMPLEMENTATION_COLORS = {"cudnn": "C0", "eager": "C1", "sdpa": "C2", "flex_attention": "C3", "flash_attention_4": "C4"}
_CPU_NOTE = "no GPU: cudnn_attention serves every attention call on its exact PyTorch fallback (counted below); cuDNN needs a GPU"


def warmup_steps(steps: int) -> int:
    """Steps left out of throughput: 1 of a short run, a tenth of a longer one, at most 5."""
    return 0 if steps < 2 else max(1, min(5, steps // 10))


def rates(
    seconds: list[float], tokens: list[float], flops: list[float], *, skip: int, peak_flops: float | None, world_size: int
) -> tuple[float | None, float | None]:
    """``(tokens/s, MFU)`` over the steps after the first ``skip``; ``tokens`` and ``flops`` per step summed over the
    ``world_size`` devices, MFU against ``peak_flops`` per device (``None`` where unknown)."""
    elapsed = sum(seconds[skip:])
    if elapsed <= 0:
        return None, None
    mfu = sum(flops[skip:]) / elapsed / (peak_flops * world_size) if peak_flops else None
    return sum(tokens[skip:]) / elapsed, mfu


def format_rate(tokens_per_s: float | None) -> str:
    """Tokens/s as the progress bars and the summary print it."""
    return "n/a" if not tokens_per_s else f"{tokens_per_s:,.0f}"


def format_mfu(mfu: float) -> str:
    """Model FLOPs utilization (a fraction) as the progress bars and the summary print it."""
    return f"{100 * mfu:.1f}%"


def header(
    *, recipe: str, model: str, implementation: str, device: str, steps: int, tokens_per_step: int, packs: list, doc_tokens: tuple[int, int]
) -> str:
    """The line a recipe prints before training (and, without a GPU, that the fallback serves cudnn)."""
    documents = sum(len(pack) for pack in packs)
    line = (
        f"{recipe}: {model}, attn_implementation={implementation!r}, {device}, {steps} steps of {tokens_per_step:,} tokens per "
        f"device ({len(packs)} packs, {documents / len(packs):.1f} documents each, {doc_tokens[0]}-{doc_tokens[1]} tokens per document)"
    )
    return f"{line}\n{_CPU_NOTE}" if implementation == "cudnn" and not str(device).startswith("cuda") else line


def announce_run(
    *, recipe: str, options, implementation: str, device, steps: int, packs: list, packs_per_step: int, world_size: int
) -> None:
    """Print the :func:`header` of a run whose optimizer steps take ``packs_per_step`` packs per device (batch size x
    gradient accumulation), and warn when its steps would repeat packs (see :func:`~.data.warn_if_repeated`)."""
    print(
        header(
            recipe=recipe,
            model=options.model_name(),
            implementation=implementation,
            device=str(device),
            steps=steps,
            tokens_per_step=options.tokens_per_step * packs_per_step,
            packs=packs,
            doc_tokens=(options.min_doc_tokens, options.max_doc_tokens),
        )
    )
    warn_if_repeated(
        packs=packs, tokens_per_step=options.tokens_per_step, steps=steps, world_size=world_size, packs_per_step=packs_per_step
    )


@contextlib.contextmanager
def fallback_announced(*, device: str):
    """Inside, the fallback's own warning for CPU tensors, and the provider's for a machine without CUDA (the Lightning
    callback installs it), stay silent on a CPU run: :func:`header` said it once already."""
    with warnings.catch_warnings():
        if not str(device).startswith("cuda"):
            from cudnn_attention import CudnnAttentionFallbackWarning, ProviderUnusedWarning

            warnings.filterwarnings("ignore", message=".*: cpu tensors$", category=CudnnAttentionFallbackWarning)
            warnings.filterwarnings("ignore", category=ProviderUnusedWarning)
        yield


def step_row(counts: dict, step_flops) -> tuple[float, float, float, float]:
    """One step's ``(tokens, padded tokens, model FLOPs, attention FLOPs)`` from the collator's counts: what each training
    engine keeps per step (as a row, so that the ranks' rows can be summed in one gather)."""
    flops, attention = step_flops(counts["doc_lengths"])
    return (counts["tokens"], counts["padded_tokens"], flops, attention)


def step_columns(rows) -> dict:
    """:class:`RunResult`'s per-step count fields from :func:`step_row` rows (summed over ranks)."""
    return {
        "tokens": [int(row[0]) for row in rows],
        "padded_tokens": [int(row[1]) for row in rows],
        "flops": [row[2] for row in rows],
        "attention_flops": [row[3] for row in rows],
    }


@dataclass(kw_only=True)
class RunResult:
    """Per-step measurements of one training run; token and FLOP counts are summed over ranks."""

    attn_implementation: str
    losses: list[float] = field(default_factory=list)  # mean over ranks
    step_seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # real tokens
    padded_tokens: list[int] = field(default_factory=list)  # what one row per document would have computed
    flops: list[float] = field(default_factory=list)
    attention_flops: list[float] = field(default_factory=list)
    world_size: int = 1
    distributed: str = "none"  # how the ranks split the work (DDP, FSDP, ...)
    device_name: str = "cpu"
    peak_flops: float | None = None  # dense bf16 peak per device, when known
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated of rank 0
    stats: dict = field(default_factory=dict)  # cudnn_attention.stats() of rank 0 for this run
    skipped: str | None = None  # why this implementation did not run

    def summary(self) -> dict:
        """Tokens/s, MFU, padding avoided, attention share, final loss, peak memory, which path served."""
        if self.skipped:
            return {"attn_implementation": self.attn_implementation, "skipped": self.skipped}
        skip = warmup_steps(len(self.step_seconds))
        tokens_per_s, mfu = rates(
            self.step_seconds, self.tokens, self.flops, skip=skip, peak_flops=self.peak_flops, world_size=self.world_size
        )
        return {
            "attn_implementation": self.attn_implementation,
            "steps": len(self.losses),
            "warmup_steps_excluded": skip,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size if tokens_per_s else None,
            "mfu": mfu,
            "real_tokens": sum(self.tokens),
            "padded_equivalent_tokens": sum(self.padded_tokens),
            "padding_avoided": 1 - sum(self.tokens) / sum(self.padded_tokens) if self.padded_tokens else None,
            "attention_flops_share": sum(self.attention_flops) / sum(self.flops) if self.flops and sum(self.flops) else None,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "peak_memory_gib": self.peak_memory_bytes / _GIB if self.peak_memory_bytes is not None else None,
            "served_by": served_by(self.stats, implementation=self.attn_implementation),
        }

    def to_json(self) -> dict:
        return {**self.summary(), "run": asdict(self)}

    def describe(self) -> list[str]:
        """Human-readable lines for the end of a run."""
        s = self.summary()
        if self.skipped:
            return [f"[{self.attn_implementation}] skipped: {self.skipped}"]
        mfu = format_mfu(s["mfu"]) if s["mfu"] is not None else "n/a (no dense bf16 peak known for this device)"
        memory = f"{s['peak_memory_gib']:.2f} GiB" if s["peak_memory_gib"] is not None else "n/a (cpu)"
        rate = format_rate(s["tokens_per_s"])
        return [
            f"[{self.attn_implementation}] loss {s['first_loss']:.4f} -> {s['final_loss']:.4f} over {s['steps']} steps",
            (
                f"[{self.attn_implementation}] tokens/s {rate} ({self.world_size} device(s), {self.distributed}, "
                f"first {s['warmup_steps_excluded']} step(s) excluded), MFU {mfu}"
            ),
            (
                f"[{self.attn_implementation}] packed {s['real_tokens']:,} real tokens; one row per document would compute "
                f"{s['padded_equivalent_tokens']:,} ({100 * (s['padding_avoided'] or 0):.0f}% padding avoided); attention is "
                f"{100 * (s['attention_flops_share'] or 0):.0f}% of the model FLOPs"
            ),
            f"[{self.attn_implementation}] peak memory {memory}; attention served by: {s['served_by']}",
        ]


def served_by(stats: dict, *, implementation: str) -> str:
    """Which attention path served the run, from ``cudnn_attention.stats()``."""
    cudnn = stats.get("cudnn_forward", 0), stats.get("cudnn_backward", 0)
    fallback = stats.get("fallback_forward", {})
    parts = []
    if any(cudnn):
        builds = stats.get("graph_builds", {})
        built = builds.get("forward", 0) + builds.get("backward", 0)
        # Graph builds fall inside the timed steps whenever a new document layout meets a new shape bucket.
        graphs = f"; {built} graphs built in {builds.get('seconds', 0.0):.1f} s" if built else ""
        parts.append(f"cuDNN ({cudnn[0]} forward, {cudnn[1]} backward calls{graphs})")
    if fallback:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in fallback.items())
        parts.append(f"the exact PyTorch fallback, not cuDNN ({reasons} forward calls)")
    return " and ".join(parts) or f"transformers' {implementation!r} (no cudnn_attention call)"


def fallback_reasons(stats: dict) -> list[str]:
    """Why the exact fallback served forward or backward calls, from ``cudnn_attention.stats()``, sorted; empty when it served none."""
    return sorted({**stats.get("fallback_forward", {}), **stats.get("fallback_backward", {})})


def write_metrics(path: str | Path, payload: dict) -> Path:
    """Write ``payload`` as indented JSON (creating the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def _legend_name(name: str, result: RunResult) -> str:
    # A cudnn run the fallback served is not a cuDNN measurement: the legend says so where the curve is read.
    fallback = result.stats.get("fallback_forward") and not result.stats.get("cudnn_forward")
    return f"{name} (exact fallback, not cuDNN)" if fallback else name


def draw_losses(results: dict[str, RunResult], *, title: str):
    """A matplotlib figure of each run's loss per optimizer step; with two runs or more, a second panel shows each run's
    difference from the baseline (eager when it ran: the reference every other implementation is judged against; else the
    first run). Each implementation keeps its colour (:data:`IMPLEMENTATION_COLORS`) in both panels."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers or CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ran = {name: result for name, result in results.items() if result.losses}
    panels = 2 if len(ran) >= 2 else 1
    figure, axes = plt.subplots(panels, 1, figsize=(8, 3.2 * panels + 1), squeeze=False, sharex=True)
    styles = ["-", "--", ":", "-."]
    colors = {name: IMPLEMENTATION_COLORS.get(name, f"C{5 + index}") for index, name in enumerate(ran)}
    for index, (name, result) in enumerate(ran.items()):
        # Distinct line styles: curves that agree would otherwise hide each other.
        axes[0][0].plot(
            range(1, len(result.losses) + 1),
            result.losses,
            label=_legend_name(name, result),
            color=colors[name],
            linewidth=1.2,
            linestyle=styles[index % len(styles)],
        )
    axes[0][0].set_ylabel("training loss")
    axes[0][0].legend()
    axes[0][0].set_title(title)
    if panels == 2:
        baseline = "eager" if "eager" in ran else next(iter(ran))
        for name, result in ran.items():
            if name == baseline:
                continue
            n = min(len(result.losses), len(ran[baseline].losses))
            difference = [x - y for x, y in zip(result.losses[:n], ran[baseline].losses[:n], strict=True)]
            axes[1][0].plot(
                range(1, n + 1), difference, color=colors[name], linewidth=1.0, label=f"{_legend_name(name, result)} - {baseline}"
            )
        axes[1][0].axhline(0.0, color="gray", linewidth=0.6)
        axes[1][0].set_ylabel(f"loss - {baseline} loss")
        axes[1][0].legend()
    axes[-1][0].set_xlabel("optimizer step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5
    figure.tight_layout()
    return figure


def plot_losses(path: str | Path, results: dict[str, RunResult], *, title: str) -> Path:
    """Write :func:`draw_losses`'s figure to ``path`` (PNG, creating the folder)."""
    figure = draw_losses(results, title=title)
    import matplotlib.pyplot as plt  # after draw_losses chose the file-only backend

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def comparison(results: dict[str, RunResult], *, primary: str, reference: str) -> dict:
    """Loss-curve difference, speedup (tokens/s ratio) and peak memory of ``primary`` against ``reference``.

    Two views of the per-step loss difference: the max abs (and relative) difference, which single spikes
    dominate, and the mean abs difference over the second half of the run, which a systematic gap (a wrong
    gradient trains worse step after step) dominates once the trajectories have separated.
    """
    first, second = results[primary], results.get(reference)
    if second is None or second.skipped:
        return {"reference": reference, "skipped": second.skipped if second else "not run"}
    n = min(len(first.losses), len(second.losses))
    diffs = [abs(a - b) for a, b in zip(first.losses[:n], second.losses[:n], strict=True)]
    scale = max(abs(x) for x in second.losses[:n])
    a, b = first.summary(), second.summary()
    return {
        "reference": reference,
        "steps": n,
        "loss_max_abs_diff": max(diffs),
        "loss_max_rel_diff": max(diffs) / scale if scale else 0.0,
        "loss_mean_abs_diff_second_half": sum(diffs[n // 2 :]) / len(diffs[n // 2 :]),
        "speedup_tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"] if a["tokens_per_s"] and b["tokens_per_s"] else None,
        "tokens_per_s": {primary: a["tokens_per_s"], reference: b["tokens_per_s"]},
        "peak_memory_gib": {primary: a["peak_memory_gib"], reference: b["peak_memory_gib"]},
    }


def describe_comparison(result: dict, *, primary: str) -> str:
    """One line for the end of a compare run."""
    reference = result["reference"]
    if "skipped" in result:
        return f"compare {primary} vs {reference}: skipped ({result['skipped']})"
    speedup = f"{result['speedup_tokens_per_s']:.2f}x" if result["speedup_tokens_per_s"] else "n/a"
    memory = ", ".join(f"{name} {gib:.2f} GiB" for name, gib in result["peak_memory_gib"].items() if gib is not None) or "n/a (cpu)"
    return (
        f"compare {primary} vs {reference} over {result['steps']} steps: loss max |diff| {result['loss_max_abs_diff']:.3g} "
        f"(relative {result['loss_max_rel_diff']:.3g}; second-half mean {result['loss_mean_abs_diff_second_half']:.3g}), "
        f"speedup {speedup} tokens/s, peak memory {memory}"
    )


def finish(
    *, recipe: str, results: dict[str, RunResult], primary: str, config: dict, output_dir: str | Path, title: str, write: bool = True
) -> dict:
    """The metrics of a recipe run; with ``write`` (rank zero only) also print the summary and write ``metrics.json`` and ``loss.png``.

    ``results`` holds the primary run first, then the compared ones; ``payload["comparisons"]`` compares the
    primary with each, and ``payload["loss_max_abs_diff_vs_eager"]`` / ``["loss_mean_abs_diff_second_half_vs_eager"]``
    give every run's distance from eager (when eager ran): the primary's is judged against the other implementations'.
    """
    first = results[primary]
    references = [name for name in results if name != primary]
    payload = {
        "recipe": recipe,
        "config": config,
        "versions": versions(),  # what the figures depend on: two runs' files can be told apart later
        "device": first.device_name,
        "world_size": first.world_size,
        "dense_bf16_peak_flops": first.peak_flops,
        "runs": {name: result.to_json() for name, result in results.items()},
        "comparisons": {reference: comparison(results, primary=primary, reference=reference) for reference in references},
    }
    eager = results.get("eager")
    if eager is not None and not eager.skipped:
        against_eager = {
            name: comparison(results, primary=name, reference="eager")
            for name, result in results.items()
            if name != "eager" and not result.skipped
        }
        for key in ("loss_max_abs_diff", "loss_mean_abs_diff_second_half"):
            payload[f"{key}_vs_eager"] = {name: result[key] for name, result in against_eager.items()}
    if write:
        for result in results.values():
            print("\n".join(result.describe()))
        print(f"cudnn_attention.stats() after the {primary} run: {first.stats}")
        for reference in references:
            print(describe_comparison(payload["comparisons"][reference], primary=primary))
        if "loss_max_abs_diff_vs_eager" in payload:
            distances = ", ".join(
                f"{name} {diff:.3g} / {payload['loss_mean_abs_diff_second_half_vs_eager'][name]:.3g}"
                for name, diff in payload["loss_max_abs_diff_vs_eager"].items()
            )
            print(f"loss-curve distance from eager (max |diff| / second-half mean |diff|): {distances}")
        metrics = write_metrics(Path(output_dir) / RESULTS, payload)
        try:
            plot = plot_losses(Path(output_dir) / "loss.png", results, title=title)
        except ImportError:  # the run's figures are in the JSON already; do not fail a finished run over a plot
            print(f'wrote {metrics}; no loss.png: matplotlib is not installed (pip install -e ".[recipes]")')
        else:
            print(f"wrote {metrics} and {plot}")
    return payload
