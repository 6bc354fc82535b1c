"""User mistakes (a missing file, a wrong field name, a preset this machine cannot run) as one line, not a traceback.

A message names the flag to change the way the running command spells it (:func:`flag`): ``--text_field`` for the
Trainer recipes, ``--model.text_field`` for the Lightning recipe, which sets its spelling with :func:`flag_spelling`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import re
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import NoReturn

__all__ = [
    "EXTRAS",
    "OneLineArgumentParser",
    "RecipeError",
    "command_name",
    "flag",
    "flag_spelling",
    "missing_extra",
    "option_strings",
    "run_command",
    "trainer_flag",
    "usage_error",
]


class RecipeError(ValueError):
    """A mistake in what a recipe was given (a flag, a file, the machine); the message says what to change."""


def trainer_flag(name: str, value: object = None) -> str:
    """The Trainer recipes' spelling: ``--name`` or ``--name value``."""
    return f"--{name}" if value is None else f"--{name} {value}"


# A context variable rather than an argument: the messages are written deep in the shared pieces (data, tokenizer,
# run folders), which both engines call without knowing which command runs them.
_spelling: ContextVar[Callable[[str, object], str]] = ContextVar("recipe_flag_spelling", default=trainer_flag)


def flag(name: str, value: object = None) -> str:
    """Option ``name`` (as the Trainer recipes call it: ``tokens_per_step``, ``output_dir``) spelled the way the running
    command takes it, with ``value`` when given: what a message tells the user to pass."""
    return _spelling.get()(name, value)


@contextlib.contextmanager
def flag_spelling(spell: Callable[[str, object], str]) -> Iterator[None]:
    """Inside, :func:`flag` spells options with ``spell(name, value)``."""
    token = _spelling.set(spell)
    try:
        yield
    finally:
        _spelling.reset(token)


def command_name() -> str:
    """The running script's file name, as argparse names it in its errors."""
    return Path(sys.argv[0]).name


def usage_error(prog: str, message: str, *, options: list[str] = (), help_flag: str = "--help") -> NoReturn:
    """Print ``prog: error: message`` as one line on stderr (no usage block: a recipe's runs to over a hundred lines of
    ``TrainingArguments``), with the closest of ``options`` to an unrecognized flag and ``help_flag``, the flag that lists
    them all, and exit with argparse's status 2."""
    message = " ".join(message.split())
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    hints = []
    if unknown and options:
        for given in unknown.group(1).split():
            if given.startswith("--"):
                close = difflib.get_close_matches(given.split("=")[0], options, n=1)
                hints += [f"did you mean {close[0]}?"] if close else []
    hints.append(f"{prog} {help_flag} lists every flag")
    print(f"{prog}: error: {message} ({' '.join(hints)})", file=sys.stderr)
    raise SystemExit(2)


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option ``parser`` takes (what :func:`usage_error` suggests from)."""
    return [option for action in parser._actions for option in action.option_strings if option.startswith("--")]


class OneLineArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (:func:`usage_error`)."""

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, message, options=option_strings(self))


# The extra of pyproject.toml that installs each module a recipe imports.
EXTRAS = {
    "transformers": "hf",
    "accelerate": "hf",
    "lightning": "lightning",
    "jsonargparse": "lightning",
    "docstring_parser": "lightning",
    "typeshed_client": "lightning",
    "matplotlib": "recipes",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """What to install for ``error`` when it is a module one of this package's extras installs, else ``None``."""
    module = (error.name or "").split(".")[0]
    extra = EXTRAS.get(module)
    if extra is None:
        return None
    return f'this recipe needs {module}, which is not installed: pip install -e ".[{extra}]" (the {extra!r} extra of cudnn-attention)'


def run_command(main: Callable[[list[str] | None], object]) -> None:
    """Run a recipe's ``main`` as a command: a :class:`RecipeError`, or a module a missing extra would install, ends it with
    one line on stderr and exit status 2 (argparse's status for usage errors); strict mode refusing a call ends it with
    one line and status 1; any other exception keeps its traceback (a bug, not a user mistake)."""
    from cudnn_attention import StrictModeError

    try:
        main(None)
    except RecipeError as error:
        print(f"{command_name()}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except ModuleNotFoundError as error:
        message = missing_extra(error)
        if message is None:
            raise
        print(f"{command_name()}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except StrictModeError as error:
        print(f"{command_name()}: error: {error}; leave out {flag('strict')} to let the exact fallback serve such calls", file=sys.stderr)
        raise SystemExit(1) from None
