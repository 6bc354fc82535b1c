"""Where a run's files go: a new folder per run, never one that already holds another run's results, none left empty."""

from __future__ import annotations

import time
from pathlib import Path

from .errors import RecipeError, flag

__all__ = ["checked_output_dir", "new_run_dir", "remove_empty_dirs"]

RESULTS = "metrics.json"  # what marks a folder as holding a finished run


def new_run_dir(recipe: str, *, root: str | Path = "runs", create: bool = True) -> Path:
    """``runs/<recipe>/<date>_<time>``, with ``-2``, ``-3``, ... when a run started in the same second; created unless
    ``create`` is false (a rank other than zero only needs the name)."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    base = Path(root) / recipe
    _check_folder(base, named="the runs folder")
    for attempt in range(1, 1000):
        path = base / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        if not create:
            if not path.exists():
                return path
            continue
        try:
            path.mkdir(parents=True)
        except FileExistsError:
            continue
        return path
    raise RecipeError(f"{base} holds 999 runs started at {stamp}: pass {flag('output_dir')}")


def checked_output_dir(output_dir: str | Path, *, overwrite: bool) -> tuple[Path, Path]:
    """``(output_dir, keep)``: ``output_dir`` unless it holds a finished run (its ``metrics.json``) and ``overwrite`` is false,
    and the folder that stays if the run leaves nothing there (:func:`remove_empty_dirs`): ``output_dir`` when it exists
    already, else its parent. Call it before the run creates anything there, so that what exists is the user's."""
    path = Path(output_dir)
    _check_folder(path, named=flag("output_dir", path))
    if not overwrite and (path / RESULTS).exists():
        raise RecipeError(
            f"{path} already holds a run ({RESULTS}): pass another output directory, or {flag('overwrite_output_dir')} to replace it"
        )
    keep = path if path.exists() else path.parent
    return path, keep


def _check_folder(path: Path, *, named: str) -> None:
    """Raise :class:`RecipeError` when ``path`` cannot be a folder: it, or the nearest of its parents that exists, is a file."""
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under {existing}, which is a file"
        raise RecipeError(f"{named} {where}, not a folder: pass {flag('output_dir')} with a folder (a new one is created)")


def remove_empty_dirs(path: str | Path, *, keep: str | Path) -> None:
    """Remove the empty folders under ``path`` (deepest first), then ``path`` and its parents while they are empty, up to but
    not including ``keep`` (a folder that existed before the run, or the one ``runs/`` sits in)."""
    path, keep = Path(path).absolute(), Path(keep).absolute()
    if not path.is_dir():
        return
    for folder in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    while path != keep and keep in path.parents and not any(path.iterdir()):
        path.rmdir()
        path = path.parent
