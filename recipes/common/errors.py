"""User mistakes (a missing file, a wrong field name, a preset this machine cannot run) as one line, not a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["RecipeError", "run_command"]


class RecipeError(ValueError):
    """A mistake in what a recipe was given (a flag, a file, the machine); the message says what to change."""


def run_command(main: Callable[[list[str] | None], object]) -> None:
    """Run a recipe's ``main`` as a command: a :class:`RecipeError` ends it with one line on stderr and exit status 2
    (argparse's status for usage errors); any other exception keeps its traceback (a bug, not a user mistake)."""
    try:
        main(None)
    except RecipeError as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
