"""The rows packed kernels leave unwritten, on CPU: the launch code runs unchanged with emulated graphs that, like
cuDNN's, leave rows outside their documents as they found them (``emulated_cudnn``), and every output allocated without
a fill starts as NaN (stale memory). Large calls set those rows after the kernels (``packed_rows``: one prefix-sum
tensor's capacity tail; two tensors' tails, queries without keys and keys without queries), small ones through the
fills, prefix sums that cover every token through neither: each must give zero outputs and gradients and a ``-inf``
LSE there, and the same values as the fills everywhere; with a pass skipped the NaN shows, so these tests can fail."""

import itertools

import pytest
import torch

import cudnn_attention
from cudnn_attention import launch
from cudnn_attention import plan as plans
from support.emulated_cudnn import emulated
from support.fill_spy import record_fills

LENGTHS, TAIL = [5, 0, 7, 1], 3
# Two tensors of different lengths: the second document has keys and no query, the fourth a query and no key.
LENGTHS_Q, LENGTHS_KV = [5, 0, 7, 1], [4, 2, 7, 0]


def _run(monkeypatch, prefix_sums: str, sinks: bool):
    """out, lse and the gradients of q, k, v (and the sinks) for ``prefix_sums``: "one" tensor for both sides,
    "two" tensors of equal values, "unequal" ones (``LENGTHS_Q``, ``LENGTHS_KV``), or one "covering" every token
    (no capacity tail)."""
    torch.manual_seed(0)
    tail = 0 if prefix_sums == "covering" else TAIL
    lengths_q, lengths_kv = (LENGTHS_Q, LENGTHS_KV) if prefix_sums == "unequal" else (LENGTHS, LENGTHS)
    cu = torch.tensor([0, *itertools.accumulate(lengths_q)], dtype=torch.int32)
    cu_kv = cu if prefix_sums in ("one", "covering") else torch.tensor([0, *itertools.accumulate(lengths_kv)], dtype=torch.int32)
    T, T_kv = sum(lengths_q) + tail, sum(lengths_kv) + tail
    q = torch.randn(T, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(T_kv, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True) if sinks else None
    if prefix_sums == "covering":  # as the transformers layer proves it of its batches
        cudnn_attention.packed_batch(cu, cu, 7, 7, tokens_q=T, tokens_kv=T, validate=True, cover_all=True)
    with emulated(monkeypatch), cudnn_attention.strict():
        out, lse = cudnn_attention.varlen_attention(q, k, v, cu, cu_kv, 7, 7, causal=True, window_size=(3, 0), sinks=sink, return_lse=True)
        leaves = [t for t in (q, k, v, sink) if t is not None]
        grads = torch.autograd.grad((out * torch.randn_like(out)).sum() + lse[lse.isfinite()].sum(), leaves)
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("sink_forward", [None, "fold", "engine"])
def test_one_prefix_sum_tensor_sets_its_tail_after_the_kernels(sink_forward, monkeypatch):
    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    if sink_forward is not None:
        monkeypatch.setattr(plans, "sink_forward", lambda: sink_forward)
    seen = record_fills(monkeypatch, poison=True)
    out, lse, grads = _run(monkeypatch, "one", sinks=sink_forward is not None)
    # No fill (the backward allocates twice: the loss uses the LSE): the pass, or the fold, set the tail.
    assert seen == {"forward": [False], "backward": [False, False]}
    assert out[-TAIL:].abs().max() == 0 and lse[-TAIL:].isneginf().all()
    assert all(g[-TAIL:].abs().max() == 0 for g in grads[:3])
    assert not out.isnan().any() and not lse.isnan().any() and not any(g.isnan().any() for g in grads)
    monkeypatch.undo()
    if sink_forward is not None:
        monkeypatch.setattr(plans, "sink_forward", lambda: sink_forward)
    record_fills(monkeypatch, poison=True)
    want_out, want_lse, want_grads = _run(monkeypatch, "two", sinks=sink_forward is not None)  # the fills' path
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))


@pytest.mark.parametrize("sink_forward", [None, "fold", "engine"])
def test_two_prefix_sum_tensors_set_their_unwritten_rows_after_the_kernels(sink_forward, monkeypatch):
    if sink_forward is not None:
        monkeypatch.setattr(plans, "sink_forward", lambda: sink_forward)
    record_fills(monkeypatch, poison=True)
    want_out, want_lse, want_grads = _run(monkeypatch, "unequal", sinks=sink_forward is not None)  # small: the fills
    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    seen = record_fills(monkeypatch, poison=True)
    out, lse, grads = _run(monkeypatch, "unequal", sinks=sink_forward is not None)
    assert seen == {"forward": [False], "backward": [False, False]}
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    no_key, no_query = slice(12, 13), slice(4, 6)  # the fourth document's query, the second one's keys
    assert out[no_key].abs().max() == 0 and lse[no_key].isneginf().all() and grads[0][no_key].abs().max() == 0
    assert grads[1][no_query].abs().max() == 0 and grads[2][no_query].abs().max() == 0
    assert all(g[-TAIL:].abs().max() == 0 for g in grads[:3]) and out[-TAIL:].abs().max() == 0


def test_small_calls_keep_their_fills(monkeypatch):
    seen = record_fills(monkeypatch, poison=True)
    for prefix_sums in ("one", "two", "unequal"):  # below _PASS_AFTER_MIN_ELEMENTS
        out, lse, grads = _run(monkeypatch, prefix_sums, sinks=False)
        assert out[-TAIL:].abs().max() == 0 and lse[-TAIL:].isneginf().all() and not out.isnan().any()
        assert not any(g.isnan().any() for g in grads)
    assert seen == {"forward": [True] * 3, "backward": [True] * 6}


def test_prefix_sums_covering_every_token_need_neither(monkeypatch):
    seen = record_fills(monkeypatch, poison=True)
    out, lse, grads = _run(monkeypatch, "covering", sinks=False)
    assert seen == {"forward": [False], "backward": [False, False]}
    assert not out.isnan().any() and not any(g.isnan().any() for g in grads)


def test_the_poison_shows_a_tail_left_unset(monkeypatch):
    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    monkeypatch.setattr(launch, "fill_past_last_document", lambda cu, fills: None)
    record_fills(monkeypatch, poison=True)
    out, lse, grads = _run(monkeypatch, "one", sinks=False)
    assert out[-TAIL:].isnan().all() and lse[-TAIL:].isnan().all() and grads[0][-TAIL:].isnan().all()


def test_the_poison_shows_rows_left_unset(monkeypatch):
    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    monkeypatch.setattr(launch, "fill_rows", lambda fills: None)
    record_fills(monkeypatch, poison=True)
    out, lse, grads = _run(monkeypatch, "unequal", sinks=False)
    assert out[12].isnan().all() and lse[-TAIL:].isnan().all() and grads[0][12].isnan().all()
    assert grads[1][4:6].isnan().all() and grads[2][-TAIL:].isnan().all()
