import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
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
