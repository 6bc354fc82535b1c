"""End-to-end measurements of the recipes: loss curves, tokens/s and peak memory against eager, sdpa and
flex_attention measured in the same run, a long-context configuration, and multi-GPU scaling.

    python3 benchmarks/recipe_training.py --suite loss --out benchmarks/results     # 200-step loss curves against eager (1 GPU)
    python3 benchmarks/recipe_training.py --suite loss --seeds 0 1 2                # the same for three seeds (init and batch order)
    python3 benchmarks/recipe_training.py --suite speed --out benchmarks/results    # tokens/s and memory, small and long presets (1 GPU)
    python3 benchmarks/recipe_training.py --suite scaling --out benchmarks/results  # 1 GPU against 2-GPU DDP and FSDP (2 GPUs)
    python3 benchmarks/recipe_training.py --suite loss --quick                       # the plumbing on a CPU: tiny preset, 3 steps

Every case (and seed) is one recipe command (the same a user types, ``accelerate launch`` included) in its own process;
its ``metrics.json`` is read back and summarized in ``recipes_<suite>.md`` / ``.json``, with each case's loss
curve (``recipes_<suite>/<case>.png``) and log. The gpt-oss-like cases compare with ``flash_attention_4`` too (FlashAttention's
CuTe kernels, with a learnable-sink backward on sm90/sm100), reported as skipped with the reason where it is not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cudnn_attention.recipes.common.reporting import IMPLEMENTATION_COLORS

ROOT = Path(__file__).resolve().parents[1]
FUSED = ("sdpa", "flex_attention", "flash_attention_4")  # the implementations whose distance from eager bounds cudnn's
_EXIT_NOISE = re.compile(r"leaked (instance|type|function)|nanobind|skipped remainder|refleaks")


@dataclass(frozen=True)
class Case:
    """One recipe command: ``launch`` is ``python``, ``ddp`` (accelerate --multi_gpu) or ``fsdp`` (the shipped accelerate config);
    ``seed`` (model init and batch order) is the recipe's default when None."""

    name: str
    recipe: str
    args: tuple[str, ...]
    launch: str = "python"
    gpus: int = 1
    env: dict = field(default_factory=dict)
    seed: int | None = None

    @property
    def label(self) -> str:
        return run_label(self.name, self.seed)


def run_label(case: str, seed: int | None) -> str:
    """The name of one run's output directory, log and plot, and its cell in the tables."""
    return case if seed is None else f"{case}-seed{seed}"


def _trainer(name, recipe, *args, **kwargs) -> Case:
    return Case(name, recipe, tuple(args), **kwargs)


def cases(suite: str, *, quick: bool = False, steps: int | None = None) -> list[Case]:
    """The cases of ``suite``; ``steps`` replaces each case's step count; ``quick`` shrinks each to the tiny preset
    and 3 steps (CPU plumbing check)."""
    if suite == "loss":
        # 4096 tokens per step: eager materializes each document's score matrix, and must fit.
        small = ("--size", "small", "--tokens_per_step", "4096", "--max_steps", "200")
        found = [
            _trainer("sliding_window", "train_sliding_window", *small, "--compare", "eager", "sdpa", "flex_attention"),
            _trainer("sinks", "train_sinks", *small, "--compare", "eager", "flex_attention", "flash_attention_4"),  # gpt-oss has no sdpa
            _trainer(
                "lightning",
                "train_lightning",
                "--model.size=small",
                "--model.tokens_per_step=4096",
                "--trainer.max_steps=200",
                "--trainer.enable_progress_bar=false",
                "--compare=[eager,sdpa]",
            ),
        ]
    elif suite == "speed":
        short = ("--size", "small", "--max_steps", "60")
        long = ("--size", "long", "--max_steps", "20")
        found = [
            # No eager for the Mistral-like model at 16k tokens per step: eager computes every score of the packed row, and the
            # case with it did not finish within 200 s on an H200. The loss suite compares it with eager at 4096 tokens.
            _trainer("sliding_window", "train_sliding_window", *short, "--compare", "flex_attention", "sdpa"),
            _trainer("sinks", "train_sinks", *short, "--compare", "flex_attention", "flash_attention_4", "eager"),
            # No eager at 16k-32k documents: one layer's score matrix alone (16 heads x 32k x 32k fp32) is 64 GiB.
            _trainer("sliding_window_long", "train_sliding_window", *long, "--compare", "flex_attention", "sdpa"),
            _trainer("sinks_long", "train_sinks", *long, "--compare", "flex_attention", "flash_attention_4"),
        ]
    elif suite == "scaling":
        small = ("--size", "small", "--max_steps", "40")
        found = []
        for recipe in ("train_sliding_window", "train_sinks"):
            found += [
                _trainer(f"{recipe}_1gpu", recipe, *small, env={"CUDA_VISIBLE_DEVICES": "0"}),
                _trainer(f"{recipe}_ddp", recipe, *small, launch="ddp", gpus=2),
                _trainer(f"{recipe}_fsdp", recipe, *small, launch="fsdp", gpus=2),
            ]
        found += [
            _trainer(
                "lightning_fsdp",
                "train_lightning",
                "--model.size=small",
                "--trainer.max_steps=40",
                "--trainer.devices=2",
                "--trainer.strategy=fsdp",
                "--trainer.enable_progress_bar=false",
                gpus=2,
            ),
        ]
    else:
        raise ValueError(f"unknown suite {suite!r}; suites: loss, speed, scaling")
    if quick:
        return [_with_steps(case, 3, tiny=True) for case in found]
    return [_with_steps(case, steps) for case in found] if steps else found


def _with_steps(case: Case, steps: int, *, tiny: bool = False) -> Case:
    """``case`` with ``steps`` optimizer steps; ``tiny`` also swaps its size preset (and token budget) for the tiny one."""
    lightning = case.recipe == "train_lightning"
    replaced = ("--max_steps", "--size", "--tokens_per_step") if tiny else ("--max_steps",)
    replaced_lightning = ("--trainer.max_steps=", "--model.size=", "--model.tokens_per_step=") if tiny else ("--trainer.max_steps=",)
    args, skip_value = [], False
    for arg in case.args:
        if skip_value:
            skip_value = False
        elif arg in replaced:
            skip_value = True  # its value goes too
        elif not arg.startswith(replaced_lightning):
            args.append(arg)
    args += [f"--trainer.max_steps={steps}"] if lightning else ["--max_steps", str(steps)]
    if tiny:
        args += ["--model.size=tiny"] if lightning else ["--size", "tiny"]
    return dataclasses.replace(case, args=tuple(args))


def command(case: Case, output_dir: Path) -> list[str]:
    """The command line of ``case``, writing into ``output_dir``."""
    script = str(ROOT / "recipes" / f"{case.recipe}.py")
    lightning = case.recipe == "train_lightning"
    out = [f"--trainer.default_root_dir={output_dir}"] if lightning else ["--output_dir", str(output_dir)]
    if case.seed is not None:  # the Lightning recipe seeds its model and batch order from hparams, the rest of the run from the CLI
        out += [f"--model.seed={case.seed}", f"--seed_everything={case.seed}"] if lightning else ["--seed", str(case.seed)]
    launcher = [sys.executable]
    if case.launch == "ddp":
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(case.gpus)]
    elif case.launch == "fsdp":
        launcher = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "recipes" / "accelerate_fsdp.yaml"),
            "--num_processes",
            str(case.gpus),
        ]
    return [*launcher, script, *case.args, *out]


def shown(argv: list[str]) -> str:
    """``argv`` as a user would type it from the project root."""
    text = " ".join(argv).replace(f"{sys.executable} -m accelerate.commands.launch", "accelerate launch").replace(sys.executable, "python3")
    return text.replace(f"{ROOT}/", "")


def run_case(case: Case, out: Path, *, timeout: float) -> dict:
    """Run ``case``; its metrics (``metrics.json``) with the command and wall time, or the failure."""
    output_dir = out / "runs" / case.label
    shutil.rmtree(output_dir, ignore_errors=True)
    argv = command(case, output_dir)
    log = out / "logs" / f"{case.label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n=== {case.label}: {shown(argv)}", flush=True)
    start = time.perf_counter()
    with log.open("w") as sink:
        try:
            rc = subprocess.run(
                argv, cwd=ROOT, env={**os.environ, **case.env}, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    # The recipe's own summary lines (the progress bar and library chatter stay in the log).
    summary = [line for line in text.splitlines() if line.startswith(("[", "compare", "loss-curve", "cudnn_attention.stats"))]
    print("\n".join(summary) or text[-3000:], flush=True)
    record = {"case": case.name, "seed": case.seed, "command": shown(argv), "launch": case.launch, "gpus": case.gpus}
    record |= {"wall_s": seconds, "rc": rc}
    metrics = output_dir / "metrics.json"
    if rc != 0 or not metrics.exists():
        # The cuDNN frontend's nanobind reports objects alive at interpreter exit; keep the error, not that list.
        lines = [line for line in text.splitlines() if not _EXIT_NOISE.search(line)]
        return {**record, "failed": "\n".join(lines[-60:])}
    if (output_dir / "loss.png").exists():
        shutil.copy(output_dir / "loss.png", out / f"{case.label}.png")
    return {**record, "metrics": json.loads(metrics.read_text())}


def _f(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _mfu(run: dict) -> str:
    return "-" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"


def _distances(metrics: dict, name: str) -> tuple[float, float] | None:
    """(max abs, second-half mean abs) difference of ``name``'s per-step losses from eager's, when both ran."""
    maxima, means = metrics.get("loss_max_abs_diff_vs_eager", {}), metrics.get("loss_mean_abs_diff_second_half_vs_eager", {})
    return (maxima[name], means[name]) if name in maxima else None


def _label(record: dict) -> str:
    return run_label(record["case"], record.get("seed"))


def _row(*cells, width: int = 0) -> str:
    """A Markdown table row, padded with empty cells to ``width``."""
    cells = [str(cell) for cell in cells] + [""] * (width - len(cells))
    return "| " + " | ".join(cells) + " |"


def _table(columns: list[str], records: list[dict], row_cells, failed_cells) -> list[str]:
    """Header plus ``row_cells(record)`` (a list of rows) for each record, or ``failed_cells(record)`` for a failed one."""
    lines = [_row(*columns), "|" + "---|" * len(columns)]
    for record in records:
        rows = [failed_cells(record)] if "failed" in record else row_cells(record)
        lines += [_row(*cells, width=len(columns)) for cells in rows]
    return lines


def _implementation_cells(record: dict) -> list[list]:
    """The rows of one case: each implementation that ran (or why it was skipped)."""
    rows = []
    metrics = record["metrics"]
    runs = metrics["runs"]
    primary = next(iter(runs))
    for name, run in runs.items():
        if "skipped" in run:
            rows.append([_label(record), name, f"skipped: {run['skipped'][:120]}"])
            continue
        speedup = runs[primary]["tokens_per_s"] / run["tokens_per_s"] if run["tokens_per_s"] else None
        distance = _distances(metrics, name)
        distance_text = "reference" if name == "eager" else "-" if distance is None else f"{distance[0]:.3g} / {distance[1]:.3g}"
        rows.append(
            [
                _label(record),
                name,
                run["steps"],
                _f(run["tokens_per_s"], ",.0f"),
                f"{_f(speedup, '.2f')}x",
                _mfu(run),
                _f(run["peak_memory_gib"], ".2f"),
                distance_text,
                run["served_by"],
            ]
        )
    return rows


def implementation_rows(records: list[dict]) -> list[str]:
    """One Markdown row per (case, implementation): tokens/s, speedup of cudnn, MFU, peak memory, loss distance from eager."""
    columns = [
        "case",
        "implementation",
        "steps",
        "tokens/s",
        "cudnn speedup",
        "MFU",
        "peak GiB",
        "loss diff from eager: max / second-half mean",
        "attention served by",
    ]

    def failed(r):
        return [_label(r), f"failed (rc {r['rc']})", *[""] * 6, f"see logs/{_label(r)}.log"]

    return _table(columns, records, _implementation_cells, failed)


def _metrics_by_case(records: list[dict]) -> dict[str, list[dict]]:
    """The metrics of each case's finished runs (one per seed), in the order they ran."""
    by_case: dict[str, list[dict]] = {}
    for record in records:
        if record.get("metrics"):
            by_case.setdefault(record["case"], []).append(record["metrics"])
    return by_case


def loss_verdicts(records: list[dict]) -> list[str]:
    """Per case: cudnn's loss-curve distance from eager against the other fused implementations' (both measures), averaged
    over the case's seeds when it ran with several.

    One run is a noisy yardstick: training amplifies each kernel's bf16 rounding into a trajectory of its own, and which
    kernel lands furthest from eager changes from seed to seed. The mean over seeds is what the verdict compares.
    """
    lines = []
    for case, seeds in _metrics_by_case(records).items():
        per_seed = {name: [_distances(metrics, name) for metrics in seeds] for name in ("cudnn", *FUSED)}
        per_seed = {name: runs for name, runs in per_seed.items() if all(runs)}  # ran (against eager) for every seed
        if "cudnn" not in per_seed or len(per_seed) < 2:
            continue
        mean = {name: tuple(sum(run[i] for run in runs) / len(runs) for i in (0, 1)) for name, runs in per_seed.items()}
        others = {name: d for name, d in mean.items() if name != "cudnn"}
        within = all(mean["cudnn"][i] <= max(d[i] for d in others.values()) for i in (0, 1))
        others_text = ", ".join(f"{name} {d[0]:.3g} / {d[1]:.3g}" for name, d in others.items())
        seeds_text = ""
        if len(seeds) > 1:
            listed = "; ".join(f"{name} " + ", ".join(f"{run[1]:.3g}" for run in runs) for name, runs in per_seed.items())
            # Paired by seed: a kernel that is really further from eager is further in most seeds, not in a mean that one
            # spike can carry.
            nearer = "; ".join(
                f"cudnn at most {name}'s in "
                + " and ".join(f"{sum(c[i] <= o[i] for c, o in zip(per_seed['cudnn'], runs))}/{len(runs)}" for i in (0, 1))
                for name, runs in per_seed.items()
                if name != "cudnn"
            )
            seeds_text = f" (means over {len(seeds)} seeds; second-half means per seed: {listed}; seeds with {nearer}, max and second half)"
        lines.append(
            f"- {case}: cudnn {mean['cudnn'][0]:.3g} / {mean['cudnn'][1]:.3g} vs {others_text}{seeds_text}: "
            f"{'within' if within else 'OUTSIDE'} what the other fused kernels show"
        )
    return lines


def plot_seed_distances(records: list[dict], out: Path) -> list[Path]:
    """For each case run with several seeds, ``<case>-seeds.png``: each implementation's per-step |loss - eager loss|,
    averaged over the seeds (thin lines: each seed). What the verdict's means summarize, step by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for case, metrics in _metrics_by_case(records).items():
        seeds = [seed["runs"] for seed in metrics]
        if len(seeds) < 2 or any("eager" not in runs for runs in seeds):
            continue
        figure, axis = plt.subplots(figsize=(8, 4))
        for index, name in enumerate(name for name in seeds[0] if name != "eager"):
            curves = [
                [abs(x - y) for x, y in zip(runs[name]["run"]["losses"], runs["eager"]["run"]["losses"], strict=True)]
                for runs in seeds
                if runs.get(name, {}).get("run")
            ]
            if not curves:
                continue
            color = IMPLEMENTATION_COLORS.get(name, f"C{5 + index}")  # the recipes' colour for each implementation
            for curve in curves:
                axis.plot(range(1, len(curve) + 1), curve, color=color, linewidth=0.4, alpha=0.35)
            mean = [sum(values) / len(values) for values in zip(*curves, strict=False)]
            axis.plot(range(1, len(mean) + 1), mean, color=color, linewidth=1.6, label=f"{name} (mean of {len(curves)} seeds)")
        axis.set_yscale("log")
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("|loss - eager loss|")
        axis.set_title(f"{case}: distance from eager, same seed, weights and batches")
        axis.legend()
        figure.tight_layout()
        path = out / f"{case}-seeds.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def scaling_rows(records: list[dict]) -> list[str]:
    """Per-GPU throughput of each multi-GPU run against the 1-GPU run of the same recipe."""
    single = {}
    for record in records:
        if record["gpus"] == 1 and "metrics" in record:
            single[record["metrics"]["recipe"]] = record["metrics"]["runs"]["cudnn"]["tokens_per_s"]
    columns = [
        "case",
        "launch",
        "GPUs",
        "distributed",
        "tokens/s (all GPUs)",
        "tokens/s per GPU",
        "per-GPU scaling vs 1 GPU",
        "MFU",
        "peak GiB (rank 0)",
        "final loss",
    ]

    def cells(record: dict) -> list[list]:
        metrics = record["metrics"]
        run = metrics["runs"]["cudnn"]
        base = single.get(metrics["recipe"])
        per_gpu = run["tokens_per_s_per_device"]
        scaling = per_gpu / base if base and per_gpu and record["gpus"] > 1 else None
        return [
            [
                _label(record),
                record["launch"],
                metrics["world_size"],
                run["run"]["distributed"],
                _f(run["tokens_per_s"], ",.0f"),
                _f(per_gpu, ",.0f"),
                _f(scaling, ".2f"),
                _mfu(run),
                _f(run["peak_memory_gib"], ".2f"),
                _f(run["final_loss"], ".4f"),
            ]
        ]

    return _table(columns, records, cells, lambda r: [_label(r), r["launch"], r["gpus"], f"failed (rc {r['rc']})"])


def report(suite: str, records: list[dict], *, header: str) -> str:
    lines = [f"# Recipes, suite `{suite}`", "", header, ""]
    lines += (
        ["Commands (from the project root):", ""] + [f"- `{_label(r)}`: `{r['command']}` ({r['wall_s']:.0f} s)" for r in records] + [""]
    )
    if suite == "scaling":
        lines += scaling_rows(records)
    else:
        lines += implementation_rows(records)
        # The speed suite's few steps on one seed are no verdict on the curves: the loss suite's seeds are.
        verdicts = loss_verdicts(records) if suite == "loss" else []
        if verdicts:
            lines += [
                "",
                "Loss-curve distance from eager, max / second-half mean abs difference of per-step losses (same seed, weights "
                "and batches):",
                "",
            ]
            lines += verdicts
    return "\n".join(lines) + "\n"


def environment() -> str:
    import torch

    parts = [f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.insert(0, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
        parts.append(f"cuDNN backend {torch.backends.cudnn.version()}")
    try:
        import cudnn

        parts.append(f"cuDNN frontend {cudnn.__version__}")
    except ImportError:
        parts.append("no cuDNN frontend")
    import transformers

    parts.append(f"transformers {transformers.__version__}")
    return "Measured on " + ", ".join(parts) + f", {time.strftime('%Y-%m-%d')}."


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("loss", "speed", "scaling"), required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks")
    parser.add_argument("--quick", action="store_true", help="tiny preset, 3 steps: check the plumbing (CPU)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of every case (default: each case's own)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these case names")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="run each case once per seed (default: the recipes' seed)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per case")
    args = parser.parse_args(argv)
    selected = [case for case in cases(args.suite, quick=args.quick, steps=args.steps) if args.only is None or case.name in args.only]
    selected = [dataclasses.replace(case, seed=seed) for case in selected for seed in args.seeds] if args.seeds else selected
    import torch

    if not args.quick and not torch.cuda.is_available():
        # The suites train the small and long presets for tens to hundreds of steps: days on a CPU, where only the plumbing can run.
        parser.error(
            f"--suite {args.suite} trains the GPU presets and this machine has no GPU: on a CPU pass --quick (tiny preset, 3 steps)"
        )
    if any(case.gpus > max(1, torch.cuda.device_count()) for case in selected):
        parser.error(f"suite {args.suite!r} needs {max(case.gpus for case in selected)} GPUs; this machine has {torch.cuda.device_count()}")
    out = args.out / f"recipes_{args.suite}"
    out.mkdir(parents=True, exist_ok=True)
    header, records = environment(), []
    for case in selected:
        records.append(run_case(case, out, timeout=args.timeout))
        # Rewritten after every case: a run cut short still leaves the cases it finished.
        text = report(args.suite, records, header=header)
        (args.out / f"recipes_{args.suite}.md").write_text(text)
        (args.out / f"recipes_{args.suite}.json").write_text(json.dumps(records, indent=1, default=str) + "\n")
    if args.suite == "loss":
        plot_seed_distances(records, out)
    print("\n" + text)
    return records


if __name__ == "__main__":
    main()
