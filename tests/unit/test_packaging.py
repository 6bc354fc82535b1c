"""The installed distribution: the cuDNN frontend only where it ships wheels, and the package without it (macOS)."""

from importlib.metadata import requires, version

import pytest

import cudnn_attention
from support.child_process import last_json, run_python

packaging_markers = pytest.importorskip("packaging.requirements")

LINUX_X86 = {"sys_platform": "linux", "platform_machine": "x86_64"}
LINUX_ARM = {"sys_platform": "linux", "platform_machine": "aarch64"}
WINDOWS = {"sys_platform": "win32", "platform_machine": "AMD64"}
MACOS_ARM = {"sys_platform": "darwin", "platform_machine": "arm64"}
MACOS_X86 = {"sys_platform": "darwin", "platform_machine": "x86_64"}
LINUX_PPC = {"sys_platform": "linux", "platform_machine": "ppc64le"}


def test_version_is_the_packages_own():
    assert version("cudnn-attention") == cudnn_attention.__version__  # pyproject reads it (dynamic); a stale install differs


@pytest.mark.parametrize(
    "platform, wanted",
    [(LINUX_X86, True), (LINUX_ARM, True), (WINDOWS, True), (MACOS_ARM, False), (MACOS_X86, False), (LINUX_PPC, False)],
)
def test_the_frontend_is_required_only_where_it_ships_wheels(platform, wanted):
    # nvidia-cudnn-frontend 1.32 has wheels for Linux x86_64/aarch64 and Windows AMD64 and no sdist: anywhere
    # else a requirement on it would make `pip install cudnn-attention` fail.
    (line,) = [line for line in requires("cudnn-attention") if line.startswith("nvidia-cudnn-frontend")]
    requirement = packaging_markers.Requirement(line)
    assert requirement.marker is not None, line
    assert requirement.marker.evaluate({**platform, "extra": ""}) is wanted


def test_without_the_frontend_the_package_imports_and_runs_the_exact_fallback():
    # As on macOS, where the dependency above is skipped: `import cudnn` fails.
    code = """if True:
        import json, sys
        sys.modules["cudnn"] = None  # makes `import cudnn` raise ImportError
        import torch
        import cudnn_attention
        import cudnn_attention.integrations.hf, cudnn_attention.integrations.lightning
        from cudnn_attention.frontend import frontend_unavailable_reason

        q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
        out = cudnn_attention.attention(q, k, v, causal=True)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
        error = max((a - b).abs().max().item() for a, b in zip((out, *grads), (expected, *expected_grads)))
        with cudnn_attention.enabled():
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
        print(json.dumps([error, cudnn_attention.stats()["fallback_forward"], frontend_unavailable_reason()]))
    """
    error, fallbacks, reason = last_json(run_python(code, timeout=120))
    assert error < 1e-5 and fallbacks == {"cpu tensors": 1}
    assert reason.startswith("cuDNN frontend not importable (ModuleNotFoundError"), reason
