"""What a user meets in the recipes on a CPU machine: each mistake ends before any training in one line on stderr that
says what to change, with a non-zero exit status and nothing written that looks like a result; the advice a warning
gives works when followed; the Lightning recipe names its own flags."""

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import cudnn_attention

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

# After the skips: a machine without the extras skips this module before importing the recipes.
from cudnn_attention.recipes import quickstart, train_lightning, train_sliding_window  # noqa: E402
from cudnn_attention.recipes.common import RecipeDataWarning  # noqa: E402
from cudnn_attention.recipes.common.errors import run_command  # noqa: E402
from cudnn_attention.recipes.common.hf_trainer import parse  # noqa: E402

pytestmark = pytest.mark.no_gpu  # --strict, --size and the device defaults are what a machine without a GPU does
RECIPES = Path(train_sliding_window.__file__).parent


def _command(module, argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    """Run a recipe as its script does (``run_command(main)``, or argparse's own exit); its exit status and stderr lines."""
    monkeypatch.setattr(sys, "argv", [str(RECIPES / f"{module.__name__.rsplit('.', 1)[-1]}.py"), *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        if module is quickstart:
            module.main()
        else:
            run_command(module.main)
    return stopped.value.code, capsys.readouterr().err.strip().splitlines()


def _left_behind(folder: Path, inputs: set[str]) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name not in inputs)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory holding the inputs the mistakes need: an empty text, a folder without tokenizer files,
    a plain file where a folder should be."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "a_file").write_text("not a folder")
    return tmp_path


TRAINER_MISTAKES = [
    # Item 1: an empty dataset trained 5 steps on NaN and exited 0; the advice it gave then ended in a ValueError.
    (["--dataset", "empty.txt"], r"dataset 'empty.txt' has no text: pass a --dataset with at least one non-empty document"),
    (["--tokens_per_step", "1"], r"--tokens_per_step 1: pass 2 or more \(a document's first token has no label.*\)"),
    (["--tokens_per_step", "0"], r"--tokens_per_step 0: pass 2 or more"),  # was taken as "the preset's" silently
    (["--max_steps", "0"], r"--max_steps 0: pass 1 or more"),  # was accepted silently
    (["--max_doc_tokens", "1"], r"--max_doc_tokens 1: pass 2 or more"),
    (
        ["--min_doc_tokens", "600", "--max_doc_tokens", "100"],
        (
            r"--min_doc_tokens 600 is longer than the longest document, 100 tokens \(--max_doc_tokens 100\): "
            r"pass a --min_doc_tokens of at most 100"
        ),
    ),
    (["--min_doc_tokens", "600"], r"--min_doc_tokens 600 is longer than the longest document, 512 tokens \(the tiny preset's; "),
    (["--strict"], r"--strict turns every call cuDNN cannot serve into an error, and without a GPU .* leave out --strict"),
    # It trained, metrics.json said fp16 True, and the loss equalled the fp32 run's: accelerate turns fp16 off on a CPU.
    (["--fp16"], r"--fp16 needs a GPU: on a CPU .* trains in float32 .*: leave out --fp16, or pass --bf16 for bfloat16 autocast"),
    (["--tokenizer", "no_tokenizer"], r"tokenizer directory 'no_tokenizer' holds no tokenizer transformers can load \(.*\): pass a "),
    (["--output_dir", "a_file"], r"--output_dir a_file is a file, not a folder: pass --output_dir with a folder"),
    (["--output_dir", "a_file/run"], r"--output_dir a_file/run lies under .*a_file, which is a file, not a folder"),
    (["--report_to", "tensorbord"], r"--report_to tensorbord: transformers knows no integration 'tensorbord'; pass one of .*tensorboard"),
    # Item 5: a mistyped flag printed the usage of every TrainingArguments field (about 127 lines) first.
    (["--max_stpes", "2"], r"unrecognized arguments: --max_stpes 2 \(did you mean --max_steps\? train_sliding_window.py --help-all lists"),
    (["--size", "huge"], r"argument --size: invalid choice: 'huge'"),
]


@pytest.mark.parametrize(("argv", "expected"), TRAINER_MISTAKES, ids=[" ".join(argv) for argv, _ in TRAINER_MISTAKES])
def test_a_trainer_recipe_mistake_ends_in_one_line_before_training(argv, expected, workdir, capsys, monkeypatch):
    status, lines = _command(train_sliding_window, ["--max_steps", "1", *argv], capsys, monkeypatch)
    assert status == 2 and len(lines) == 1, lines
    assert re.fullmatch(rf"train_sliding_window\.py: error: {expected}.*", lines[0]), lines[0]
    assert _left_behind(workdir, {"empty.txt", "no_tokenizer", "a_file"}) == []  # no folder, no metrics.json, no plot


def test_report_to_an_integration_that_is_not_installed_names_the_package(workdir, capsys, monkeypatch):
    import transformers.integrations

    # tensorboard may be installed where this runs: stand in for a machine without it.
    monkeypatch.setattr(transformers.integrations, "get_available_reporting_integrations", list)
    status, lines = _command(train_sliding_window, ["--max_steps", "1", "--report_to", "tensorboard"], capsys, monkeypatch)
    expected = "train_sliding_window.py: error: --report_to tensorboard needs tensorboard, which is not installed here: pip install "
    expected += "tensorboard"
    assert (status, lines) == (2, [expected])
    assert _left_behind(workdir, {"empty.txt", "no_tokenizer", "a_file"}) == []


def test_gradient_checkpointing_as_the_readme_writes_it_raises_no_warning():
    # transformers 5.24 renamed it activation_checkpointing and warns (FutureWarning) about the old name; 5.17 has only it.
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, _, args = parse(["--gradient_checkpointing"])
    assert args.gradient_checkpointing is True
    assert getattr(args, "activation_checkpointing", True) is True  # where the new name exists, it carries the value


def test_the_advice_for_data_smaller_than_a_step_works_when_followed(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("0123456789")  # 10 bytes and the end of text: 11 tokens, fewer than the tiny preset's shortest document
    with pytest.warns(RecipeDataWarning, match=r"pass --tokens_per_step 11 or less, or more data"):
        train_sliding_window.main(["--dataset", str(book), "--max_steps", "1", "--output_dir", str(tmp_path / "first")])
    # Following it used to end in "ValueError: need 1 <= min_tokens <= max_tokens, got 16, 11".
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeDataWarning)
        argv = ["--dataset", str(book), "--max_steps", "1", "--tokens_per_step", "11", "--output_dir", str(tmp_path / "second")]
        payload = train_sliding_window.main(argv)
    assert payload["runs"]["cudnn"]["real_tokens"] == 11
    assert payload["config"]["min_doc_tokens"] == payload["config"]["max_doc_tokens"] == 11
    # Item 8: the file says what it ran with.
    versions = json.loads((tmp_path / "second" / "metrics.json").read_text())["versions"]
    assert (versions["torch"], versions["transformers"], versions["gpu"]) == (torch.__version__, transformers.__version__, "cpu")
    assert versions["cudnn_attention"] == cudnn_attention.__version__


def test_quickstart_refuses_an_empty_sequence_in_one_line(capsys, monkeypatch):
    status, lines = _command(quickstart, ["--seq", "0"], capsys, monkeypatch)
    expected = "quickstart.py: error: argument --seq: '0' is not a positive whole number of tokens: pass 1 or more "
    expected += "(quickstart.py --help lists every flag)"
    assert (status, lines) == (2, [expected])


def test_strict_mode_refusing_a_call_mid_run_is_one_line(capsys, monkeypatch):
    from cudnn_attention import StrictModeError

    def refused(argv):
        raise StrictModeError("cudnn_attention strict mode: cuDNN cannot serve this call (head_dim 72)")

    monkeypatch.setattr(sys, "argv", ["train_sinks.py"])
    with pytest.raises(SystemExit) as stopped:
        run_command(refused)
    assert stopped.value.code == 1
    expected = "train_sinks.py: error: cudnn_attention strict mode: cuDNN cannot serve this call (head_dim 72); leave out --strict to let "
    assert capsys.readouterr().err.strip().splitlines() == [expected + "the exact fallback serve such calls"]


LIGHTNING_MISTAKES = [
    # Item 3: the messages named the Trainer recipes' flags (--text_field), which LightningCLI rejects.
    (["--model.dataset=data.jsonl"], r"data.jsonl:1 has no field 'text' \(fields: \['body'\]\): pass --model.text_field with the field"),
    (
        ["--model.min_doc_tokens=600", "--model.max_doc_tokens=100"],
        (
            r"--model.min_doc_tokens=600 is longer than the longest document, 100 tokens \(--model.max_doc_tokens=100\): pass a "
            r"--model.min_doc_tokens of at most 100"
        ),
    ),
    (["--model.tokens_per_step=1"], r"--model.tokens_per_step=1: pass 2 or more"),
    (["--trainer.max_steps=0"], r"--trainer.max_steps=0: pass 1 or more"),
    (["--model.strict=true"], r"--model.strict turns every call cuDNN cannot serve into an error, .* leave out --model.strict"),
    (["--trainer.default_root_dir=a_file"], r"--trainer.default_root_dir=a_file is a file, not a folder: pass --trainer.default_root_dir"),
    (["--model.dataset=empty.txt"], r"dataset 'empty.txt' has no text: pass a --model.dataset with at least one non-empty document"),
    # Item 5: LightningCLI printed about 60 lines of usage before these.
    (["--model.max_doc_tokns=100"], r"unrecognized arguments: --model.max_doc_tokns=100 \(did you mean --model.max_doc_tokens\? "),
    (["--model.size=huge"], r"Parser key \"model.size\": Expected a typing.Literal\[.*\]. Got value: huge \(train_lightning.py --help"),
]


@pytest.mark.parametrize(("argv", "expected"), LIGHTNING_MISTAKES, ids=[" ".join(argv) for argv, _ in LIGHTNING_MISTAKES])
def test_a_lightning_recipe_mistake_names_its_own_flags_in_one_line(argv, expected, workdir, capsys, monkeypatch):
    (workdir / "data.jsonl").write_text('{"body": "a"}\n')
    status, lines = _command(train_lightning, ["--trainer.enable_progress_bar=false", *argv], capsys, monkeypatch)
    assert status == 2 and len(lines) == 1, lines
    assert re.fullmatch(rf"train_lightning\.py: error: {expected}.*", lines[0]), lines[0]
    assert _left_behind(workdir, {"empty.txt", "no_tokenizer", "a_file", "data.jsonl"}) == []


def test_lightning_takes_a_bare_overwrite_output_dir_and_records_versions(tmp_path):
    (tmp_path / "metrics.json").write_text("{}")  # a finished run's folder
    # A bare flag, as the one-line error advises (it used to get "expected one argument").
    argv = ["--overwrite_output_dir", "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"]
    argv.append("--trainer.enable_progress_bar=false")
    payload = train_lightning.main(argv)
    import lightning

    assert payload["versions"]["lightning"] == lightning.__version__ and payload["versions"]["gpu"] == "cpu"
    assert '"versions"' in (tmp_path / "metrics.json").read_text()


def _script(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(
    ("recipe", "module", "extra"), [("train_lightning", "lightning", "lightning"), ("train_sinks", "transformers", "hf")]
)
def test_a_recipe_without_its_extra_says_what_to_install(recipe, module, extra, tmp_path):
    # Item 2: the README's main job installs .[hf,recipes]; train_lightning.py then ended in a ModuleNotFoundError traceback.
    script = str(RECIPES / f"{recipe}.py")
    code = f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = [{script!r}]; runpy.run_path(sys.argv[0], run_name='__main__')"
    done = _script(code, tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    expected = f'{recipe}.py: error: this recipe needs {module}, which is not installed: pip install -e ".[{extra}]" '
    assert done.stderr.strip().splitlines()[-1] == expected + f"(the {extra!r} extra of cudnn-attention)"
    assert not any(tmp_path.iterdir())
