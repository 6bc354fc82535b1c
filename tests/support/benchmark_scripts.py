"""Running the benchmark scripts from tests without importing them into the test process.

``run_script`` runs ``python3 benchmarks/<name>.py ...`` from the repository root, as the README does. ``check_in_script``
runs test code in a fresh interpreter that has imported the script the way its own run would (``benchmarks/`` first on
``sys.path``): for the pieces a command line cannot reach (the profile arithmetic, the timing in turns); a failing
``assert`` there fails the test with the child's traceback.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from support.child_process import run_python, succeeded

__all__ = ["BENCHMARKS", "ROOT", "check_in_script", "run_script"]

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def run_script(name: str, *argv: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python3 benchmarks/<name>.py argv...`` with this interpreter, from the repository root; a failing run does not raise."""
    command = [sys.executable, str(BENCHMARKS / f"{name}.py"), *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def check_in_script(name: str, code: str, *argv: str, timeout: float = 600) -> str:
    """Run ``code`` (dedented) after ``import <name>`` from ``benchmarks/``; it must exit 0. Returns its stripped stdout."""
    prelude = f"import sys\nsys.path.insert(0, {str(BENCHMARKS)!r})\nimport {name}\n"
    return succeeded(run_python(prelude + textwrap.dedent(code), *argv, timeout=timeout))
