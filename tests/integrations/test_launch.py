"""``cudnn-attention run -- <command>``: "cudnn" in programs that never import cudnn_attention, in every process they start.

Each test runs the installed console script on a command that names "cudnn" only as a string (on CPU the
exact fallback serves, counted in ``stats()``), with the package's start-up hook turned off
(``CUDNN_ATTENTION_NO_AUTOLOAD=1``); the same command without the launcher is then refused by transformers.
"""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from cudnn_attention.integrations.hf import launch
from support.child_process import last_json

transformers = pytest.importorskip("transformers")

TIMEOUT = 300


def _script(name: str) -> str | None:
    """The console script pip wrote for this interpreter (its own scripts directory, or the user scheme's)."""
    filename = f"{name}.exe" if os.name == "nt" else name
    for scheme in (sysconfig.get_default_scheme(), sysconfig.get_preferred_scheme("user")):
        script = Path(sysconfig.get_path("scripts", scheme)) / filename
        if script.exists():
            return str(script)
    return None


def _run(command: list[str], *, launcher: bool = True, cwd=None, env=None) -> subprocess.CompletedProcess:
    if launcher and _script("cudnn-attention") is None:
        pytest.fail("console script cudnn-attention not installed: run `pip install -e .`")
    full = [_script("cudnn-attention"), "run", "--", *command] if launcher else command
    # The start-up hook the package installs (tests/integrations/test_autoload.py) off: the launcher alone must serve.
    env = {**(os.environ if env is None else env), "CUDNN_ATTENTION_NO_AUTOLOAD": "1"}
    return subprocess.run(full, capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, env=env, check=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama with its own BPE tokenizer, and a JSON-lines dataset of short documents, made here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("launch")
    texts = [f"document {i}: " + " ".join(f"w{(7 * i + j) % 50}" for j in range(5 + i % 13)) for i in range(64)]
    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>", "<pad>"], show_progress=False))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    tokenizer.save_pretrained(root / "model")
    transformers.LlamaForCausalLM(config).save_pretrained(root / "model")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return root


# ----------------------------------------------------------------------------------------------
# The launcher itself
# ----------------------------------------------------------------------------------------------


def test_bootstrap_goes_first_on_pythonpath_once():
    sep = os.pathsep
    env = launch.command_environment(environ={"PYTHONPATH": f"/a{sep}{launch.BOOTSTRAP_DIR}{sep}/b", "OTHER": "1"})
    assert env == {"PYTHONPATH": f"{launch.BOOTSTRAP_DIR}{sep}/a{sep}/b", "OTHER": "1"}
    assert launch.command_environment(environ={})["PYTHONPATH"] == str(launch.BOOTSTRAP_DIR)


@pytest.mark.parametrize(
    "argv, message", [(["run"], "needs a command after --"), (["run", "--", "no-such-program-x"], "'no-such-program-x' not found")]
)
def test_run_without_a_runnable_command_says_what_to_give(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_start_up_imports_nothing_and_a_shadowed_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    code = (
        "import json, os, sys; "
        "print(json.dumps([sorted(m for m in ('torch', 'transformers', 'cudnn_attention') if m in sys.modules), "
        "os.environ.get('THEIRS_RAN')]))"
    )
    result = _run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert last_json(result) == [[], "1"]


def test_a_model_named_by_string_runs_cudnn_in_the_processes_the_command_starts(checkpoint):
    # The command starts another interpreter, as accelerate launch and torchrun do; only the inner one loads the model.
    inner = textwrap.dedent(f"""
        import json, sys, torch, transformers
        model = transformers.AutoModelForCausalLM.from_pretrained({str(checkpoint / "model")!r}, attn_implementation="cudnn")
        model(torch.randint(0, 100, (2, 9)))
        hooked = "cudnn_attention" in sys.modules  # imported by the launcher's hook, not by this program
        from cudnn_attention import stats
        from cudnn_attention.integrations.hf import _compat
        print(json.dumps([hooked, _compat.attn_implementation_of(model), stats()["fallback_forward"]]))
    """)
    outer = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {inner!r}]))"
    assert last_json(_run([sys.executable, "-c", outer])) == [True, "cudnn", {"cpu tensors": 2}]  # one call per layer
    refused = _run([sys.executable, "-c", outer], launcher=False)
    assert refused.returncode != 0 and 'attn_implementation="cudnn"` is not supported' in refused.stderr


# ----------------------------------------------------------------------------------------------
# TRL: SFTTrainer and the `trl sft` command line
# ----------------------------------------------------------------------------------------------


def test_trl_sft_trainer_padding_free_and_packing(checkpoint, tmp_path):
    pytest.importorskip("trl")
    script = textwrap.dedent(f"""
        import json, sys
        from datasets import load_dataset
        from trl import SFTConfig, SFTTrainer

        dataset = load_dataset("json", data_files={str(checkpoint / "data" / "train.jsonl")!r}, split="train")
        seen = {{}}
        for name, options in (("padding_free", dict(padding_free=True, max_length=None, per_device_train_batch_size=4)),
                              ("packing", dict(packing=True, max_length=64, per_device_train_batch_size=2))):
            args = SFTConfig(output_dir={str(tmp_path)!r} + "/" + name, max_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                             model_init_kwargs={{"attn_implementation": "cudnn"}}, **options)
            trainer = SFTTrainer(model={str(checkpoint / "model")!r}, args=args, train_dataset=dataset)
            hooked = "cudnn_attention" in sys.modules  # imported by the launcher's hook, not by this program
            from cudnn_attention import reset_stats, stats
            from cudnn_attention.integrations.hf import _compat, attention_function

            packed = []  # calls that took the packed (cu_seq_lens) path
            varlen = attention_function.varlen_attention
            attention_function.varlen_attention = lambda *args, **kwargs: packed.append(1) or varlen(*args, **kwargs)
            reset_stats()
            trainer.train()
            attention_function.varlen_attention = varlen
            seen[name] = [hooked, _compat.attn_implementation_of(trainer.model), sum(stats()["fallback_forward"].values()), len(packed)]
        print(json.dumps(seen))
    """)
    seen = last_json(_run([sys.executable, "-c", script], cwd=tmp_path))
    for name, (hooked, implementation, calls, packed) in seen.items():
        # At least 2 steps x 2 layers (TRL's default activation checkpointing adds the recomputed forwards), every
        # call on the packed path: padding-free batches reach the attention function as one row with cu_seq_lens.
        assert hooked and implementation == "cudnn" and calls >= 4 and packed == calls, (name, seen)


def test_trl_sft_command_line(checkpoint, tmp_path):
    pytest.importorskip("trl")
    trl = _script("trl")
    if trl is None:
        pytest.fail("trl is importable but its console script is not installed")
    # `trl sft` re-launches itself through accelerate launch: the model loads in a child process. Packing
    # (best-fit decreasing) implies padding_free. Without the launcher transformers refuses the name, as the
    # test above shows on a smaller command.
    command = [
        trl,
        "sft",
        "--model_name_or_path",
        str(checkpoint / "model"),
        "--dataset_name",
        str(checkpoint / "data"),
        "--attn_implementation",
        "cudnn",
        "--packing",
        "--max_length",
        "64",
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "1",
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--use_cpu",
    ]
    result = _run(command, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
