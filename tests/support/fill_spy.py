"""What the launch code asks of its packed output allocations: the ``zero_tails`` each one gets (whether it is
zero-filled before the kernels), and, when asked, NaN in every output allocated without its fill (stale memory)."""

from cudnn_attention import launch


def record_fills(monkeypatch, *, poison: bool = False) -> dict:
    """``{"forward": [...], "backward": [...]}``: the ``zero_tails`` of each allocation, in call order; with ``poison``,
    outputs allocated without their fill start as NaN (on a GPU, ``gpu_checks.poison_allocator`` does that for a test's
    first call; the fuzz workers poison here). ``monkeypatch``: pytest's fixture or a ``pytest.MonkeyPatch()``."""
    seen = {"forward": [], "backward": []}
    for direction, name in (("forward", "allocate_forward_outputs"), ("backward", "allocate_backward_outputs")):
        real = getattr(launch, name)

        def spy(*args, _real=real, _seen=seen[direction], **kwargs):
            tensors = _real(*args, **kwargs)
            filled = kwargs.get("zero_tails", True)
            _seen.append(filled)
            if poison and not filled:
                for t in tensors:
                    if t is not None:
                        t.fill_(float("nan"))
            return tensors

        monkeypatch.setattr(launch, name, spy)
    return seen
