"""cudnn_attention.environment.versions(): the versions a run records, framework-free and truthful on a CPU machine."""

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

import cudnn_attention
from cudnn_attention import environment

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
    if torch.cuda.is_available():
        assert found["gpu"] == torch.cuda.get_device_name() and found["gpu_count"] == torch.cuda.device_count()
        assert found["torch_cudnn"] == torch.backends.cudnn.version()
    else:
        assert (found["gpu"], found["gpu_count"], found["torch_cudnn"], found["cudnn_backend"]) == ("cpu", 0, None, None)


def test_a_machine_without_a_gpu_is_named_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    found = environment.versions()
    assert (found["gpu"], found["gpu_count"], found["torch_cudnn"], found["cudnn_backend"]) == ("cpu", 0, None, None)


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
