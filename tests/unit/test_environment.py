"""cudnn_attention.environment.versions(): the versions a run records, framework-free and truthful on a CPU machine."""

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

import cudnn_attention
from cudnn_attention import environment
from support.fake_frontend import install_fake_frontend

KEYS = {
    "cudnn_attention",
    "python",
    "torch",
    "cuda",
    "torch_cudnn",
    "cudnn_backend",
    "cudnn_frontend",
    "transformers",
    "lightning",
    "gpu",
    "gpu_count",
}


def test_versions_names_what_this_process_runs_with():
    found = environment.versions()
    assert set(found) == KEYS
    assert json.loads(json.dumps(found)) == found  # it goes into metrics.json as it is
    assert found["cudnn_attention"] == cudnn_attention.__version__
    assert found["torch"] == torch.__version__
    assert found["cuda"] == torch.version.cuda
    assert found["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    for key, distribution in (("transformers", "transformers"), ("cudnn_frontend", "nvidia-cudnn-frontend")):
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        assert found[key] == installed, key
    assert found["torch_cudnn"] == torch.backends.cudnn.version()  # None for a CPU build of torch
    if torch.cuda.is_available():
        assert found["gpu"] == torch.cuda.get_device_name() and found["gpu_count"] == torch.cuda.device_count()
    else:
        assert (found["gpu"], found["gpu_count"]) == ("cpu", 0)
    if torch.version.cuda is None:  # a CPU build loads no cuDNN; the frontend finds none either
        assert (found["torch_cudnn"], found["cudnn_backend"]) == (None, None)


def test_a_machine_without_a_gpu_is_named_cpu_and_still_reports_the_cudnn_it_loads(monkeypatch):
    # A login node with a CUDA build of torch: both cuDNN versions are read from the libraries, no GPU needed, so the
    # doctor there names the errata of the library its jobs will load.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 92801)
    install_fake_frontend(monkeypatch, 92801)
    found = environment.versions()
    assert (found["gpu"], found["gpu_count"], found["torch_cudnn"], found["cudnn_backend"]) == ("cpu", 0, 92801, 92801)


def test_a_cudnn_that_does_not_load_is_none(monkeypatch):
    def no_library():
        raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(torch.backends.cudnn, "version", no_library)
    # what frontend 1.32 raises beside a CPU build of torch
    install_fake_frontend(monkeypatch, RuntimeError("Unable to find symbol cudnnGetVersion"))
    found = environment.versions()
    assert (found["torch_cudnn"], found["cudnn_backend"], found["cudnn_frontend"]) == (None, None, "1.32.0")


def test_a_frontend_that_does_not_import_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # `import cudnn` raises ImportError
    found = environment.versions()
    assert found["cudnn_frontend"] is None and found["cudnn_backend"] is None


@pytest.mark.parametrize("absent", ["transformers", "lightning"])
def test_an_absent_framework_is_none(monkeypatch, absent):
    real = importlib.metadata.version

    def version(name):
        if name in (absent, "pytorch-lightning"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert environment.versions()[absent] is None


def test_versions_imports_no_framework():
    code = (
        "import sys, cudnn_attention.environment as e; e.versions(); "
        "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# The tested ranges: written once (environment.TESTED), flagged by the doctor, the README's and CI's
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("torch_version", "transformers_version", "flagged"),
    [
        ("2.13.0+cpu", "5.25.0", []),
        ("2.9.1", "5.17.0", []),
        ("2.15.0+cu130", "5.24.0", []),
        ("2.16.0a0+git1234", "5.25.0", ["torch"]),
        ("2.8.0", "5.26.0", ["torch", "transformers"]),
        ("2.13.0", "5.16.2", ["transformers"]),
        ("2.13.0", None, []),  # transformers not installed: nothing to say about it
    ],
)
def test_the_doctor_flags_a_version_outside_the_tested_ranges(torch_version, transformers_version, flagged, monkeypatch):
    from cudnn_attention import doctor

    real = environment.versions

    def versions():
        return {**real(), "torch": torch_version, "transformers": transformers_version}

    if torch.cuda.is_available():
        pytest.skip("the notes are read from a CPU report, which runs no check")
    monkeypatch.setattr(environment, "versions", versions)
    notes = doctor.build_report().notes
    outside = [note for note in notes if "outside the versions this package is tested with" in note]
    assert [note.split()[0] for note in outside] == flagged, notes
    for name, note in zip(flagged, outside):
        low, high = environment.TESTED[name]
        assert note.startswith(f"{name} {versions()[name]} is outside") and f"({low} to {high})" in note, note


def test_the_readme_and_ci_name_the_tested_ranges():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = " ".join((root / "README.md").read_text().split())
    for name, (low, high) in environment.TESTED.items():
        assert f"{name} {low} to {high}" in readme, name
    ci = (root / ".ci" / "run").read_text()
    (loop,) = [line for line in ci.splitlines() if line.startswith("for transformers in ")]
    tested = loop.split(" in ")[1].split(";")[0].split()
    low, high = environment.TESTED["transformers"]
    assert tested[0].startswith(f"{high}.") and tested[-1].startswith(f"{low}."), tested  # newest first, the floor last
