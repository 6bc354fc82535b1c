"""The recipes as a command-line tool, on CPU: TrainingArguments pass through, every run gets a folder of its own, the
progress bars show what the summary reports, user mistakes end in one line, small data warns, the Lightning recipe's
flags are described, plots and the quick start say what ran, and the docs match the code."""

import dataclasses
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from cudnn_attention.recipes import quickstart, train_lightning, train_sliding_window
from cudnn_attention.recipes.common import (
    RecipeDataWarning,
    RecipeError,
    RunResult,
    StepRecorder,
    check_machine,
    data_budget,
    draw_losses,
    load_texts,
    load_tokenizer,
    warn_if_repeated,
)
from cudnn_attention.recipes.common.hf_trainer import parse
from support.benchmark_scripts import run_script

pytestmark = pytest.mark.no_gpu  # the recipes on a CPU machine; on a GPU they would take it (tests/gpu/test_gpu_recipes.py)
ROOT = Path(__file__).resolve().parents[2]
LIGHTNING_QUIET = ["--trainer.enable_progress_bar=false"]


def _trainer_run(out, *extra: str) -> dict:
    return train_sliding_window.main(["--max_steps", "2", "--output_dir", str(out), *extra])


def test_training_arguments_pass_through_with_the_recipe_defaults():
    options, run, args = parse(["--report_to", "tensorboard", "--gradient_checkpointing", "--compare", "eager"], family="gpt_oss")
    assert args.report_to == ["tensorboard"] and args.gradient_checkpointing  # transformers' own flags reach the Trainer
    assert (options.family, options.size, run.compare) == ("gpt_oss", "tiny", ["eager"])
    # The recipe's defaults where the command line is silent: the size preset's steps, the recipes' optimizer, no files.
    assert (args.max_steps, args.learning_rate, args.lr_scheduler_type.value, args.warmup_steps) == (5, 5e-4, "cosine", 0)
    assert (args.weight_decay, args.seed, args.save_strategy.value, args.use_cpu, args.bf16) == (0.1, 0, "no", True, False)
    assert args.output_dir is None  # run() makes a folder of its own
    options, _, args = parse(["--max_steps", "40", "--learning_rate", "1e-3", "--attn", "eager", "--model", "llama"])
    assert (args.max_steps, args.warmup_steps, args.logging_steps, args.learning_rate) == (40, 4, 4, 1e-3)
    assert (options.attn_implementation, options.family) == ("eager", "llama")  # the old --attn / --model spellings still work


def test_a_training_arguments_flag_changes_the_run(tmp_path):
    payload = _trainer_run(tmp_path, "--gradient_checkpointing", "--save_strategy", "steps", "--save_steps", "1")
    assert payload["config"]["training_arguments"]["gradient_checkpointing"] is True
    # Each implementation's Trainer writes into its own folder of the run's: here the cudnn run's two checkpoints.
    assert sorted(p.name for p in (tmp_path / "cudnn").iterdir()) == ["checkpoint-1", "checkpoint-2"]


def test_runs_get_folders_of_their_own_and_leave_none_empty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # within the same second: the second run takes "<time>-2"
        train_sliding_window.main(["--max_steps", "1"])
    runs = sorted((tmp_path / "runs" / "train_sliding_window").iterdir())
    assert len(runs) == 2 and all(re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d(-\d+)?", run.name) for run in runs), runs
    for run in runs:  # the Trainer's own folder (runs/<recipe>/<time>/cudnn) held nothing and is gone
        assert sorted(p.name for p in run.iterdir()) == ["loss.png", "metrics.json"]


def test_an_output_dir_holding_a_run_is_refused_unless_overwritten(tmp_path):
    (tmp_path / "metrics.json").write_text("{}")
    with pytest.raises(RecipeError, match="already holds a run .* --overwrite_output_dir"):
        _trainer_run(tmp_path)
    with pytest.raises(RecipeError, match="already holds a run"):
        train_lightning.main(["--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}", *LIGHTNING_QUIET])
    payload = _trainer_run(tmp_path, "--max_steps", "1", "--overwrite_output_dir")
    assert json.loads((tmp_path / "metrics.json").read_text())["runs"].keys() == payload["runs"].keys()


@pytest.mark.parametrize("recipe", ["train_sliding_window", "train_lightning"])
def test_a_run_stopped_by_a_mistake_leaves_no_folder(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match="is not a local file"):
        if recipe == "train_lightning":
            train_lightning.main(["--model.dataset=missing.txt", *LIGHTNING_QUIET])
        else:
            train_sliding_window.main(["--dataset", "missing.txt"])
    assert not any(tmp_path.iterdir()), list(tmp_path.rglob("*"))


def _last(pattern: str, text: str) -> str:
    found = re.findall(pattern, text)
    assert found, text[-2000:]
    return found[-1]


@pytest.mark.parametrize("recipe", ["train_sliding_window", "train_lightning"])
def test_progress_bar_shows_the_summary_tokens_per_s_and_says_no_gpu_once(recipe, tmp_path, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if recipe == "train_lightning":
            payload = train_lightning.main(["--trainer.max_steps=3", f"--trainer.default_root_dir={tmp_path}"])
        else:
            payload = _trainer_run(tmp_path, "--max_steps", "3")
    out = capsys.readouterr()
    text = out.out + out.err
    summary = f"{payload['runs']['cudnn']['tokens_per_s']:,.0f}"
    # The bar's last figure is the summary's: one clock and one warm-up rule for both (StepRecorder).
    bar = _last(r"tok/s=([\d,]+)", text) if recipe == "train_lightning" else _last(r"([\d,]+) tokens/s\]", text)
    assert bar == summary, (bar, summary)
    assert f"[cudnn] tokens/s {summary} " in text
    assert "Epoch 0/-2" not in text  # Lightning's rich bar on a run bounded by steps
    assert text.count(f"{recipe}: random-init mistral (tiny), attn_implementation='cudnn', cpu, 3 steps of 1,024 tokens") == 1
    # "no GPU" once, in the header: the fallback's own warning for CPU tensors stays silent during the run.
    assert text.count("no GPU: cudnn_attention serves every attention call on its exact PyTorch fallback") == 1
    assert not [w for w in caught if "cpu tensors" in str(w.message)], [str(w.message) for w in caught]


def test_user_mistakes_are_one_line_errors(tmp_path):
    records = tmp_path / "data.jsonl"
    records.write_text('{"body": "a"}\n')
    with pytest.raises(RecipeError, match=r"data.jsonl:1 has no field 'text' \(fields: \['body'\]\): pass --text_field"):
        load_texts(dataset=str(records))
    records.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(RecipeError, match=r"data.jsonl:2 is not a JSON record"):
        load_texts(dataset=str(records))
    with pytest.raises(RecipeError, match="'missing.txt' is not a local file: pass the path of a .txt or .jsonl file"):
        load_texts(dataset="missing.txt")
    (tmp_path / "checkpoint").mkdir()
    with pytest.raises(RecipeError, match="has no tokenizer .*: pass --tokenizer DIR"):
        load_tokenizer(checkpoint=str(tmp_path / "checkpoint"))
    with pytest.raises(RecipeError, match="--size long needs a GPU with about 32 GiB .*on a CPU use --size tiny"):
        check_machine(size="long", tokens_per_step=65536, device="cpu")
    with pytest.raises(RecipeError, match="needs about 32 GiB of GPU memory and L4 has 22 GiB: pass --tokens_per_step"):
        check_machine(size="long", tokens_per_step=65536, device="cuda", gpu_name="L4", gpu_gib=22.0)
    check_machine(size="long", tokens_per_step=16384, device="cuda", gpu_name="L4", gpu_gib=22.0)  # a quarter of the tokens fits
    with pytest.raises(RecipeError, match="--size long needs a GPU"):
        train_sliding_window.main(["--size", "long", "--output_dir", str(tmp_path / "long")])
    with pytest.raises(RecipeError, match="does not support"):  # transformers has no sdpa for gpt-oss, as the primary too
        train_sliding_window.main(["--model", "gpt_oss", "--attn", "sdpa", "--max_steps", "1", "--output_dir", str(tmp_path / "sdpa")])


def test_a_mistake_on_the_command_line_ends_in_one_line_without_a_traceback(tmp_path):
    script = ROOT / "recipes" / "train_sliding_window.py"
    done = subprocess.run(
        [sys.executable, str(script), "--dataset", "book.txt"], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "train_sliding_window.py: error: dataset 'book.txt' is not a local file: "
        "pass the path of a .txt or .jsonl file (nothing is downloaded)"
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("script", "argv"), [("recipe_training", ["--suite", "speed"]), ("gradient_accuracy", [])])
def test_benchmarks_without_a_gpu_point_to_quick(script, argv):
    done = run_script(script, *argv, timeout=300)
    assert done.returncode == 2 and "no GPU: on a CPU pass --quick" in done.stderr, (done.returncode, done.stderr[-2000:])


def test_data_smaller_than_a_step_warns_with_the_numbers(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("word " * 100)  # 500 bytes, and the byte tokenizer's end of text: 501 tokens
    with pytest.warns(RecipeDataWarning, match="the data has 501 tokens, fewer than one step's 1,024: each of the 1 steps"):
        payload = _trainer_run(tmp_path / "run", "--dataset", str(book), "--max_steps", "1")
    assert payload["runs"]["cudnn"]["real_tokens"] == 501
    pack = [[1] * 1024]
    with pytest.warns(RecipeDataWarning, match=r"fills 3 packs of 1,024 tokens \(2 per device\): 10 steps of 1 go over it 5.0 times"):
        warn_if_repeated(packs=[pack] * 3, tokens_per_step=1024, steps=10, world_size=2)
    with pytest.warns(RecipeDataWarning, match=r"fewer than one step's 4,096"):  # batch size x gradient accumulation packs per step
        warn_if_repeated(packs=[pack] * 3, tokens_per_step=1024, steps=1, packs_per_step=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_repeated(packs=[pack] * 10, tokens_per_step=1024, steps=10) is None


def test_trainer_help_shows_the_recipes_own_flags_and_points_to_transformers_for_the_rest(capsys):
    # --help was 664 lines: a 130-line usage block, then every TrainingArguments field.
    from cudnn_attention.recipes.common import RecipeOptions, RunOptions

    with pytest.raises(SystemExit) as stopped:
        train_sliding_window.main(["--help"])
    assert stopped.value.code == 0
    text = capsys.readouterr().out
    own = [f.name for options in (RecipeOptions, RunOptions) for f in dataclasses.fields(options)]
    assert [flag for flag in re.findall(r"^  --(\w+)", text, re.MULTILINE) if flag != "help"] == own, text
    assert len(text.splitlines()) < 80, len(text.splitlines())
    assert "--help-all" in text and "TrainingArguments" in text and "\n  --learning_rate" not in text
    with pytest.raises(SystemExit):
        train_sliding_window.main(["--help-all"])  # every flag, the recipe's first
    full = capsys.readouterr().out
    flags = re.findall(r"^  --(\w+)", full, re.MULTILINE)
    assert flags[: len(own)] == own and "learning_rate" in flags and "report_to" in flags


def test_lightning_help_describes_every_model_flag(capsys):
    with pytest.raises(SystemExit) as stopped:
        train_lightning.main(["--help"])
    assert stopped.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    fields = dataclasses.fields(train_lightning.LightningOptions)
    assert set(re.findall(r"--model\.(\w+) ", text)) == {f.name for f in fields}  # the knobs, written once in the options
    for f in fields:
        help_text = " ".join(f.metadata["help"].split())
        assert re.search(rf"--model\.{f.name} \S+ {re.escape(help_text)} \(type:", text), (f.name, help_text)


def _result(name: str, losses: list[float], *, stats: dict | None = None) -> RunResult:
    return RunResult(attn_implementation=name, losses=losses, stats=stats or {})


def test_loss_plot_integer_steps_one_colour_per_implementation_and_fallback_named():
    fallback = {"cudnn_forward": 0, "fallback_forward": {"cpu tensors": 10}}
    results = {
        "cudnn": _result("cudnn", [5.0, 4.9, 4.8, 4.7, 4.6], stats=fallback),
        "eager": _result("eager", [5.0, 4.9, 4.8, 4.7, 4.6]),
        "sdpa": _result("sdpa", [5.0, 4.91, 4.8, 4.72, 4.6]),
    }
    figure = draw_losses(results, title="t")
    figure.canvas.draw()
    _, differences = figure.axes
    ticks = [tick for tick in differences.get_xticks() if 1 <= tick <= 5]
    assert ticks and all(tick == int(tick) for tick in ticks), ticks  # no step 2.5
    colors = {line.get_label(): line.get_color() for axis in figure.axes for line in axis.get_lines()}
    assert colors["sdpa - eager"] == colors["sdpa"] != colors["eager"]  # sdpa's difference in sdpa's colour
    assert colors["cudnn (exact fallback, not cuDNN) - eager"] == colors["cudnn (exact fallback, not cuDNN)"]
    served = {"cudnn_forward": 8, "cudnn_backward": 8, "fallback_forward": {}}
    assert [
        line.get_label() for line in draw_losses({"cudnn": _result("cudnn", [1.0, 0.9], stats=served)}, title="t").axes[0].get_lines()
    ] == ["cudnn"]


def test_step_recorder_reports_live_what_the_summary_reports(monkeypatch):
    from cudnn_attention.recipes.common import steps

    ticks = iter([0.0, 2.0, 3.0, 4.5, 5.0])
    monkeypatch.setattr(steps.time, "perf_counter", lambda: next(ticks))
    counts = {"tokens": 100, "padded_tokens": 150, "doc_lengths": [60, 40]}
    recorder = StepRecorder(step_flops=lambda lengths: (6.0 * sum(lengths), 1.0), device="cpu", planned_steps=4, world_size=1)
    recorder.begin()
    for step in range(4):
        for _ in range(2):  # two micro-batches per optimizer step (gradient accumulation)
            recorder.add_batch(counts, torch.tensor(0.5 * step))
        recorder.end_step()
        live = recorder.live()
    result = recorder.result(attn_implementation="cudnn", gather=lambda t: t[None], distributed="single process")
    assert result.step_seconds == [2.0, 1.0, 1.5, 0.5] and result.tokens == [200] * 4 and result.losses == [0.0, 1.0, 2.0, 3.0]
    assert live["tokens_per_s"] == result.summary()["tokens_per_s"] == 600 / 3.0  # the first step left out of both


def test_quickstart_checks_output_and_gradients_and_says_where_it_ran(capsys, monkeypatch):
    assert quickstart.main(["--seq", "64"])
    text = capsys.readouterr().out
    assert all(re.search(rf"^{name} +[\d.e-]+ +[\d.e-]+$", text, re.MULTILINE) for name in ("out", "dq", "dk", "dv")), text
    assert text.strip().endswith("PASS: served by the exact PyTorch fallback, not cuDNN (cpu tensors)")
    import cudnn_attention

    attention = cudnn_attention.attention
    monkeypatch.setattr(cudnn_attention, "attention", lambda *args, **kwargs: 1.01 * attention(*args, **kwargs))  # a 1% error
    assert not quickstart.main(["--seq", "64"])
    assert "FAIL (error above twice torch SDPA's)" in capsys.readouterr().out


def test_docs_match_the_code():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"(?:^|[`(]|&& )(python3?) (?:-m |recipes/|benchmarks/)", readme, re.MULTILINE)
    assert commands and set(commands) == {"python3"}, sorted(set(commands))  # one spelling, the one .ci/run uses
    long = data_budget(size="long")
    assert f"documents of {long.min_doc_tokens // 1024}k-{long.max_doc_tokens // 1024}k tokens" in train_sliding_window.__doc__
    # Figures carry their source in the repository, not a notes file that is not in it.
    benchmarks = [ROOT / "benchmarks" / name for name in ("recipe_training.py", "gradient_accuracy.py")]
    for path in [*(ROOT / "recipes").rglob("*.py"), *benchmarks, *(ROOT / "benchmarks" / "results").glob("recipes_*.md")]:
        assert "notes/" not in path.read_text() and "gpu-baseline" not in path.read_text(), path
