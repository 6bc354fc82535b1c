"""``cudnn-attention run -- <command>``: ``attn_implementation="cudnn"`` in programs you do not edit.

For ``trl sft --attn_implementation cudnn``, ``accelerate launch`` scripts, and trainers configured by YAML,
which cannot ``import cudnn_attention`` first. The command runs with the :mod:`.bootstrap` directory first on
``PYTHONPATH``; its ``sitecustomize.py`` makes every Python process of the command (``accelerate launch`` and
``torchrun`` workers included: they inherit the environment) import ``cudnn_attention`` right after
transformers' modeling code loads, as if the program began with that import. Nothing else changes: the
process imports no torch at start-up, a program that never loads transformers imports nothing, and a
``sitecustomize`` already on the path still runs. Python started with ``-S`` or ``-I`` skips the hook. Where the package is
installed its start-up hook (:mod:`cudnn_attention_autoload`) does the same for every program; the launcher installs it
for its command even where ``CUDNN_ATTENTION_NO_AUTOLOAD=1`` turns that off.

Example:
    cudnn-attention run -- trl sft --model_name_or_path ./model --attn_implementation cudnn --padding_free true ...
    cudnn-attention run -- accelerate launch train.py        # train.py passes attn_implementation="cudnn"
    CUDNN_ATTENTION_STRICT=1 cudnn-attention run -- ...      # any fallback from cuDNN raises

``cudnn-attention doctor [--model PATH_OR_CONFIG] [--json]`` checks this machine instead (:mod:`cudnn_attention.doctor`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["BOOTSTRAP_DIR", "command_environment", "main"]

BOOTSTRAP_DIR = Path(__file__).resolve().with_name("bootstrap")


def command_environment(*, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with :data:`BOOTSTRAP_DIR` first on ``PYTHONPATH``."""
    env = dict(os.environ if environ is None else environ)
    rest = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != str(BOOTSTRAP_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR), *rest])
    return env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cudnn-attention", description="cuDNN attention for commands you do not edit.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser(
        "run",
        help='run a command with attn_implementation="cudnn" available to every Python process it starts',
        description="Runs COMMAND with this package's sitecustomize first on PYTHONPATH: every Python process it starts "
        "(launcher workers included) imports cudnn_attention right after transformers' modeling code loads, which "
        'makes attn_implementation="cudnn" available. Nothing is imported at start-up.',
        epilog="example: cudnn-attention run -- trl sft --model_name_or_path ./model --attn_implementation cudnn ...",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command and its arguments, after --")
    doctor = actions.add_parser(
        "doctor",
        help="print the versions that matter and check each cuDNN path on this GPU; exit status 0 only when every check passed",
        description="Prints torch, CUDA, cuDNN, frontend, transformers and Lightning versions and the GPU, runs each path "
        "(dense, padded, packed, window, sinks) forward and backward in bfloat16 against the exact path, says whether "
        "cuDNN served it, and lists the known issues of the detected cuDNN. See docs/doctor.md.",
    )
    model_help = (
        "also check one forward and backward of this transformers model on cuDNN against eager: a directory with weights, "
        "or a config (a config.json, or a directory or hub id without weights: a small random model of its first layers)"
    )
    doctor.add_argument("--model", metavar="PATH_OR_CONFIG", help=model_help)
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``cudnn-attention``; ``run`` replaces this process with the command (its exit status is the command's);
    ``doctor`` prints its report and returns its exit status (:mod:`cudnn_attention.doctor`)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.action == "doctor":
        from ... import doctor
        from .doctor_model import model_checks, model_source_problem

        if args.model is None:
            return doctor.main(as_json=args.json)
        problem = model_source_problem(args.model)
        if problem is not None:  # before any work, as one line (argparse's own errors add a usage block)
            print(f"cudnn-attention doctor: error: {problem}", file=sys.stderr)
            return 2

        def extra(device):
            return model_checks(args.model, device=device)

        return doctor.main(as_json=args.json, extra_checks=extra, extra_checks_name=f"--model {args.model}")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run needs a command after --, e.g. cudnn-attention run -- trl sft --attn_implementation cudnn ...")
    env = command_environment()
    if os.name == "nt":  # no exec on Windows: wait for the child instead
        return subprocess.call(command, env=env)
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        parser.error(f"run: command {command[0]!r} not found: give a program on PATH or a path to one")
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
