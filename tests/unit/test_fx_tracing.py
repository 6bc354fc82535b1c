"""``_compat.fx_symbolic_tracing``: true while ``torch.fx.symbolic_trace`` runs the caller, false otherwise, with or
without torch's own ``is_fx_symbolic_tracing`` (torch versions before it read the flag)."""

import pytest
import torch

from cudnn_attention import _compat


class _Asks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.answers = []

    def forward(self, x):
        self.answers.append(_compat.fx_symbolic_tracing())
        return x + 1


@pytest.mark.parametrize("torch_has_the_asker", [True, False])
def test_true_only_while_fx_symbolic_trace_runs_the_caller(torch_has_the_asker, monkeypatch):
    if not torch_has_the_asker:
        monkeypatch.delattr(_compat._symbolic_trace, "is_fx_symbolic_tracing", raising=False)
    module = _Asks()
    module(torch.zeros(2))
    torch.fx.symbolic_trace(module)
    module(torch.zeros(2))
    assert module.answers == [False, True, False]
