"""Another provider of the same kernels: install() says so, never winning or losing silently.

nvidia-cudnn-frontend's ``cudnn.torch`` overrides the same five CUDA kernels with ``torch.library``
(``install_sdpa_overrides()``, which ``activate_flash_attention_impl("CUDNN")`` and torch's
``enable_cudnn_sdp_python`` call). Registering a kernel needs no GPU, so the real upstream provider
is used here where the frontend is installed, and a stand-in registered the same way from a file
of its own everywhere.
"""

import importlib.util
import textwrap

import pytest
import torch

import cudnn_attention
from cudnn_attention import _compat, provider
from support.provider_cpu import DENSE_OPS, VARLEN_OPS

ALL_OPS = DENSE_OPS + VARLEN_OPS


def _running(op: str) -> str:
    """Who registered the CUDA kernel the dispatcher runs for ``op``, as the provider classifies it (``_registered_by``,
    pinned on its own by the last test): "ours", "torch" (none, or a CUDA build's own), or "other", named "upstream" or
    "stand-in" for this file's two providers."""
    registrations = _compat.kernel_registrations(op, "CUDA")
    if not registrations:
        return "torch"
    where = registrations[0]
    who = provider._registered_by(where)
    if who == "us":
        return "ours"
    if who == "other" and "cudnn/torch/sdpa_provider.py" in where:
        return "upstream"
    if who == "other" and "other_provider.py" in where:
        return "stand-in"
    return who


def _sdp_settings():
    return torch.backends.cuda.cudnn_sdp_enabled(), _compat.sdp_priority_order()


@pytest.fixture
def upstream():
    """nvidia-cudnn-frontend's provider module (importing it registers only a name in torch's registry)."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        # Its install_sdpa_overrides() registers the dense kernels, then fails importing the varlen API (frontend 1.32).
        pytest.skip("nvidia-cudnn-frontend's provider needs torch.nn.attention.varlen, which this torch (2.9) lacks")
    return pytest.importorskip("cudnn.torch")


@pytest.fixture
def stand_in(tmp_path):
    """A provider of the same kernels from a file of its own, registering the way cudnn.torch does."""
    path = tmp_path / "other_provider.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch


            def _kernel(*args, **kwargs):
                raise AssertionError("never called on CPU")


            def install():
                libraries = [torch.library.Library("aten", "IMPL"), torch.library.Library("torch_attn", "IMPL")]
                for op in OPS:
                    namespace, name = op.split("::")
                    libraries[namespace == "torch_attn"].impl(name, _kernel, "CUDA")
                return libraries
            """
        ).replace("OPS", repr(ALL_OPS))  # the ops this torch defines (provider_cpu.VARLEN_OPS)
    )
    spec = importlib.util.spec_from_file_location("other_provider", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_install_refuses_the_frontends_provider_and_names_it(upstream):
    theirs = upstream.install_sdpa_overrides()
    try:
        before = _sdp_settings()
        with pytest.raises(provider.ProviderConflictError) as raised:
            cudnn_attention.install()
        message = str(raised.value)
        assert "nvidia-cudnn-frontend's provider (cudnn.torch" in message and all(op in message for op in ALL_OPS), message
        assert "install(replace_existing=True)" in message.splitlines()[-1], message
        # Nothing changed: no kernel of ours, the same SDP settings, no live handle.
        assert [_running(op) for op in ALL_OPS] == ["upstream"] * len(ALL_OPS)
        assert _sdp_settings() == before and provider.current() is None
    finally:
        theirs.remove()


def test_replace_existing_runs_ours_over_it_with_a_warning_and_remove_brings_it_back(upstream):
    theirs = upstream.install_sdpa_overrides()
    try:
        with pytest.warns(provider.ProviderConflictWarning, match=r"nvidia-cudnn-frontend's provider \(cudnn\.torch"):
            handle = cudnn_attention.install(replace_existing=True)
        assert [_running(op) for op in ALL_OPS] == ["ours"] * len(ALL_OPS)
        assert handle.shadowed_by() == {}
        handle.remove()
        assert [_running(op) for op in ALL_OPS] == ["upstream"] * len(ALL_OPS)
    finally:
        theirs.remove()
    assert "upstream" not in [_running(op) for op in ALL_OPS]


def test_a_provider_registered_over_ours_is_reported_not_silently_served(upstream):
    handle = cudnn_attention.install()
    try:
        theirs = upstream.install_sdpa_overrides()
    except RuntimeError as refused:
        # Some torch releases (2.11) let one Python kernel hold an op: then no provider can register over ours.
        assert "already a kernel registered from python" in str(refused), refused
        assert [_running(op) for op in ALL_OPS] == ["ours"] * len(ALL_OPS) and handle.shadowed_by() == {}
        handle.remove()
        return
    try:
        assert sorted(handle.shadowed_by()) == sorted(ALL_OPS) and handle.active
        with pytest.raises(provider.ProviderConflictError, match="registered over it"):
            cudnn_attention.install()
        with pytest.raises(provider.ProviderConflictError, match="registered over it"), cudnn_attention.enabled():
            pass
        with pytest.warns(provider.ProviderConflictWarning, match="registered over it"):
            assert cudnn_attention.install(replace_existing=True) is handle
        assert handle.shadowed_by() == {} and [_running(op) for op in ALL_OPS] == ["ours"] * len(ALL_OPS)
        handle.remove()
        assert [_running(op) for op in ALL_OPS] == ["upstream"] * len(ALL_OPS)
    finally:
        handle.remove()
        theirs.remove()


@pytest.mark.skipif(not hasattr(torch.nn.attention, "register_flash_attention_impl"), reason="torch without the flash-attention registry")
def test_torchs_registry_switches_between_the_two_cleanly(upstream):
    attention = torch.nn.attention
    if "CUDNN" not in attention.list_flash_attention_impls():
        pytest.skip("this frontend and torch register no 'CUDNN' implementation")
    provider.register_with_torch()
    attention.activate_flash_attention_impl("CUDNN")
    try:
        assert [_running(op) for op in ALL_OPS] == ["upstream"] * len(ALL_OPS)
        # The registry removes the active implementation before it installs the next: no conflict.
        attention.activate_flash_attention_impl(provider.TORCH_REGISTRY_NAME)
        assert [_running(op) for op in ALL_OPS] == ["ours"] * len(ALL_OPS)
        assert len(_compat.kernel_registrations(DENSE_OPS[0], "CUDA")) == len(_compat.kernel_registrations(DENSE_OPS[1], "CUDA"))
        assert not any("cudnn/torch/" in where for op in ALL_OPS for where in _compat.kernel_registrations(op, "CUDA"))
    finally:
        attention.restore_flash_attention_impl()
    assert provider.current() is None


def test_any_other_override_is_named_by_where_it_was_registered(stand_in):
    libraries = stand_in.install()
    try:
        with pytest.raises(provider.ProviderConflictError, match=r"kernels registered at .*other_provider\.py over aten::"):
            cudnn_attention.install()
        with pytest.warns(provider.ProviderConflictWarning, match=r"other_provider\.py"):
            handle = cudnn_attention.install(replace_existing=True)
        assert [_running(op) for op in ALL_OPS] == ["ours"] * len(ALL_OPS)
        handle.remove()
        assert [_running(op) for op in ALL_OPS] == ["stand-in"] * len(ALL_OPS)
    finally:
        for library in libraries:
            _compat.destroy_library(library)


def test_torchs_own_kernels_are_no_conflict():
    # A CUDA build registers aten's CUDA kernels from C++ sources; every GPU test installs over them.
    assert provider._registered_by("/__w/pytorch/pytorch/build/aten/src/ATen/RegisterCUDA_0.cpp:21904") == "torch"
    assert provider._registered_by(f"{torch.__file__.rsplit('/', 1)[0]}/_library/custom_ops.py:1104") == "torch"
    assert provider._registered_by(f"{provider.__file__}:12") == "us"
    assert provider._registered_by("/site-packages/cudnn/torch/sdpa_provider.py:301") == "other"


# ----------------------------------------------------------------------------------------------
# torch's own switch to the frontend's kernels (torch.backends.cuda.enable_cudnn_sdp_python, after torch 2.15)
# ----------------------------------------------------------------------------------------------


class _TorchSwitch:
    """A stand-in for torch's ``enable_cudnn_sdp_python``/``cudnn_sdp_python_enabled`` (torch's main branch): on, it
    installs the stand-in provider's kernels over the five ops, as torch's switch installs the frontend's."""

    def __init__(self, provider_module):
        self.provider_module = provider_module
        self.libraries = None
        self.calls = []

    def enabled(self) -> bool:
        return self.libraries is not None

    def enable(self, enabled: bool) -> None:
        self.calls.append(enabled)
        if enabled and self.libraries is None:
            self.libraries = self.provider_module.install()
        elif not enabled and self.libraries is not None:
            for library in self.libraries:
                _compat.destroy_library(library)
            self.libraries = None


@pytest.fixture
def torch_switch(stand_in, monkeypatch):
    switch = _TorchSwitch(stand_in)
    # By attribute, as the provider finds it: this torch has no such switch, torch's main branch does.
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_python_enabled", switch.enabled, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp_python", switch.enable, raising=False)
    yield switch
    switch.enable(False)


def test_torchs_switch_on_makes_install_say_what_each_would_serve(torch_switch):
    torch_switch.enable(True)
    before = _sdp_settings()
    with pytest.raises(provider.ProviderConflictError) as raised:
        cudnn_attention.install()
    message = str(raised.value)
    assert "torch.backends.cuda.enable_cudnn_sdp_python" in message, message
    assert "nvidia-cudnn-frontend's kernels" in message and "cudnn_attention's" in message, message  # what each would serve
    assert "enable_cudnn_sdp_python(False)" in message and "install(replace_existing=True)" in message, message  # what to change
    # Nothing changed: torch's switch still on, its kernels still running, no handle of ours.
    assert torch_switch.enabled() and [_running(op) for op in ALL_OPS] == ["stand-in"] * len(ALL_OPS)
    assert _sdp_settings() == before and provider.current() is None


def test_replace_existing_turns_torchs_switch_off_until_remove(torch_switch):
    torch_switch.enable(True)
    with pytest.warns(provider.ProviderConflictWarning, match=r"enable_cudnn_sdp_python.*turned off until remove\(\)"):
        handle = cudnn_attention.install(replace_existing=True)
    # One owner per kernel: the switch is off (its kernels gone, not shadowed), ours run.
    assert not torch_switch.enabled() and torch_switch.calls == [True, False]
    assert [_running(op) for op in ALL_OPS] == ["ours"] * len(ALL_OPS)
    assert not any("other_provider.py" in where for op in ALL_OPS for where in _compat.kernel_registrations(op, "CUDA"))
    handle.remove()
    assert torch_switch.enabled() and [_running(op) for op in ALL_OPS] == ["stand-in"] * len(ALL_OPS)


def test_torchs_switch_turned_on_over_ours_is_named(torch_switch):
    handle = cudnn_attention.install()
    try:
        try:
            torch_switch.enable(True)
        except RuntimeError as refused:  # torch 2.9 refuses a second Python kernel over one: no provider can go over ours
            if "already a kernel registered from python" not in str(refused):
                raise
            pytest.skip(f"this torch ({torch.__version__}) lets no Python kernel register over another")
        assert sorted(handle.shadowed_by()) == sorted(ALL_OPS)
        named = r"torch's switch torch\.backends\.cuda\.enable_cudnn_sdp_python, which is on"
        with pytest.raises(provider.ProviderConflictError, match=named):
            cudnn_attention.install()
    finally:
        handle.remove()


def test_torchs_switch_off_or_absent_changes_nothing(torch_switch):
    handle = cudnn_attention.install()  # the switch's attributes are there, and it is off
    assert [_running(op) for op in ALL_OPS] == ["ours"] * len(ALL_OPS) and torch_switch.calls == []
    handle.remove()
    assert not torch_switch.enabled() and torch_switch.calls == []
