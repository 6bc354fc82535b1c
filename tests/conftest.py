import pytest
import torch

from support.served_on_cpu import served_on_cpu  # noqa: F401 - a fixture, for every test module


def pytest_collection_modifyitems(config, items):
    # One suite for both machines: `gpu` tests need CUDA; `no_gpu` ones run the recipes as a machine without a GPU
    # does (the CPU fallback, the tiny preset), which a GPU machine would not.
    if torch.cuda.is_available():
        reason = "checks a machine without a GPU (CI runs it); tests/gpu/test_gpu_recipes.py runs the recipes here"
        unsuited, skip = "no_gpu", pytest.mark.skip(reason=reason)
    else:
        unsuited, skip = "gpu", pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if unsuited in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_counters():
    import cudnn_attention

    cudnn_attention.reset_stats()
    yield


@pytest.fixture(autouse=True)
def _nothing_left_on():
    """No test may leave the provider installed or strict mode on; cleaned up first, so one failure does not cascade."""
    yield
    import cudnn_attention
    from cudnn_attention import provider

    leaks = [
        what for what, leaked in (("the provider", provider.current() is not None), ("strict mode", cudnn_attention.is_strict())) if leaked
    ]
    if provider.current() is not None:
        provider.current().remove()
    cudnn_attention.set_strict(None)
    assert not leaks, f"left on after the test: {', '.join(leaks)}"
