"""``cudnn-attention run -- <command>``: ``attn_implementation="cudnn"`` in programs you do not edit.

For ``trl sft --attn_implementation cudnn``, ``accelerate launch`` scripts, and trainers configured by YAML,
which cannot ``import cudnn_attention`` first. The command runs with the :mod:`.bootstrap` directory first on
``PYTHONPATH``; its ``sitecustomize.py`` makes every Python process of the command (``accelerate launch`` and
``torchrun`` workers included: they inherit the environment) import ``cudnn_attention`` right after
transformers' modeling code loads, as if the program began with that import. Nothing else changes: the
process imports no torch at start-up, a program that never loads transformers imports nothing, and a
``sitecustomize`` already on the path still runs. Python started with ``-S`` or ``-I`` skips the hook.

Example:
    cudnn-attention run -- trl sft --model_name_or_path ./model --attn_implementation cudnn --padding_free true ...
    cudnn-attention run -- accelerate launch train.py        # train.py passes attn_implementation="cudnn"
    CUDNN_ATTENTION_STRICT=1 cudnn-attention run -- ...      # any fallback from cuDNN raises
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``cudnn-attention``; ``run`` replaces this process with the command (its exit status is the command's)."""
    parser = _parser()
    args = parser.parse_args(argv)
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
