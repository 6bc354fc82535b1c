"""Python code run in a fresh interpreter (for state that must not leak into, or from, the test process), and what it prints."""

import json
import subprocess
import sys
import textwrap


def run_python(code: str, *argv: str, timeout: float | None = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code argv...`` with this interpreter, ``code`` dedented; output captured as text; a failing run does not raise."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *argv], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def succeeded(result: subprocess.CompletedProcess) -> str:
    """The stripped stdout of a run that must have exited 0 (else its stderr's tail fails the test)."""
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def python_output(code: str, *, timeout: float | None = 120) -> str:
    """The stripped stdout of ``code`` run by :func:`run_python`, which must exit 0."""
    return succeeded(run_python(code, timeout=timeout))


def last_json(result: subprocess.CompletedProcess):
    """The JSON value on the last line of a run's stdout; the run must have exited 0."""
    return json.loads(succeeded(result).splitlines()[-1])
