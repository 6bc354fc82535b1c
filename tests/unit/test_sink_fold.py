"""The sink fold that serves the sink forward on the sink-less kernel (packed calls by default) and what cuDNN's
sink engine declines (single-query decode): the sink-less (out, lse) folded with the sinks equals the sink
forward, on the fp32 reference (CPU), including rows whose window leaves them no key (they see the sink
alone) and absent rows (padding, capacity tails, documents without keys: they see no sink)."""

import pytest
import torch

from cudnn_attention import plan as plans
from cudnn_attention.call import AttentionCall
from cudnn_attention.fused_sinks import fold_sinks
from cudnn_attention.masking import effective_lengths, make_mask_spec
from cudnn_attention.operands import packed_absent_rows
from cudnn_attention.reference import dense_reference, varlen_reference


def test_fold_gives_the_sink_forward_dense_with_padding_and_empty_rows():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 9, 16), torch.randn(3, 2, 11, 16), torch.randn(3, 2, 11, 16)
    sinks = torch.randn(4) * 2
    seqlens_q, seqlens_kv = effective_lengths(torch.tensor([9, 4, 3]), torch.tensor([5, 0, 2]), 9, 11)
    lengths = dict(seqlens_q_B=seqlens_q, seqlens_kv_B=seqlens_kv)
    # More queries than keys: with either mask some valid rows see no key (they see the sink alone).
    for mask in (
        make_mask_spec(causal=True, bottom_right=True, window_size=(3, -1)),
        make_mask_spec(causal=False, bottom_right=False, window_size=(0, 0)),
    ):
        out, lse = dense_reference(q, k, v, scale=0.3, mask=mask, **lengths)
        want_out, want_lse = dense_reference(q, k, v, scale=0.3, mask=mask, sinks_H=sinks, **lengths)
        absent = (torch.arange(9) >= seqlens_q.view(-1, 1)).view(3, 1, 9)
        assert (torch.isneginf(lse) & ~absent).any()  # the case this test is about
        fold_sinks(out, lse, sinks, absent)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    assert torch.isneginf(lse[1]).all() and out[1].abs().max() == 0  # a sequence with no key is absent


def _packed_case(seed: int, window: tuple[int, int], sinks: torch.Tensor):
    """The sink-less and the sink forward (fp32 reference) of 20 packed tokens: documents of 1, 6, 5 and 5 query tokens
    (the third has no key) and a capacity tail of 3; with the absent rows, (T, 1)."""
    torch.manual_seed(seed)
    q, k, v = torch.randn(20, 4, 16), torch.randn(20, 1, 16), torch.randn(20, 1, 16)
    cu_q = torch.tensor([0, 1, 7, 12, 17], dtype=torch.int32)  # a length-1 document and a capacity tail of 3
    cu_kv = torch.tensor([0, 1, 7, 7, 12], dtype=torch.int32)  # the third document has no key
    mask = make_mask_spec(causal=True, bottom_right=False, window_size=window)
    out, lse = varlen_reference(q, k, v, cu_q, cu_kv, 6, 6, scale=0.25, mask=mask)
    want_out, want_lse = varlen_reference(q, k, v, cu_q, cu_kv, 6, 6, scale=0.25, mask=mask, sinks_H=sinks)
    return out, lse, want_out, want_lse, packed_absent_rows(cu_q, cu_kv, 20)


def test_fold_gives_the_sink_forward_packed_and_nan_sinks_stay_nan():
    sinks = torch.tensor([0.5, float("nan"), -1.0, 3.0])
    out, lse, want_out, want_lse, absent = _packed_case(1, (-1, -1), sinks)
    rows = absent.squeeze(-1)
    assert rows.tolist() == [False] * 7 + [True] * 5 + [False] * 5 + [True] * 3
    fold_sinks(out, lse, sinks, absent)
    assert out[~rows][:, 1].isnan().all() and want_out[~rows][:, 1].isnan().all()
    assert out[rows].abs().max() == 0 and torch.isneginf(lse[rows]).all()
    keep = [0, 2, 3]
    torch.testing.assert_close(out[:, keep], want_out[:, keep], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[:, keep], want_lse[:, keep], rtol=1e-5, atol=1e-6)


def test_fold_ignores_what_absent_rows_held():
    # On cuDNN the fold's packed output and LSE start unfilled (the kernel leaves absent rows unwritten and the fold
    # writes every row), so whatever those rows hold, NaN here, must come out as zero output and -inf.
    sinks = torch.tensor([0.5, 2.0, -1.0, 3.0])
    out, lse, want_out, want_lse, absent = _packed_case(2, (2, 0), sinks)
    out.masked_fill_(absent.unsqueeze(-1), float("nan"))
    lse.masked_fill_(absent, float("nan"))
    fold_sinks(out, lse, sinks, absent)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


def _sink_call(*, packed: bool, needs_grad: bool) -> tuple[torch.Tensor, AttentionCall]:
    """A causal sink call of 16 packed tokens in 2 documents, or a dense (1, 2, 8, 8) one, with its q (also k and v)."""
    mask = make_mask_spec(causal=True, bottom_right=False, window_size=(-1, -1))
    q = torch.zeros(16, 2, 8) if packed else torch.zeros(1, 2, 8, 8)
    return q, AttentionCall(
        packed=packed,
        documents=2 if packed else 0,
        max_seqlen_q=8,
        max_seqlen_kv=8,
        scale=0.25,
        mask=mask,
        has_sinks=True,
        needs_grad=needs_grad,
    )


@pytest.mark.parametrize(
    ("setting", "packed", "engine_first"),
    [("auto", True, False), ("auto", False, True), ("engine", True, True), ("engine", False, True), ("fold", False, False)],
)
def test_sink_forward_setting_picks_the_graph(monkeypatch, setting, packed, engine_first):
    # By default packed sink forwards fold (cuDNN 9.19's fast engine builds no ragged sink graph; its slower
    # one takes 2-4x the sink-less forward) and dense ones ask the sink engine first.
    requested = []

    def graph_for(direction, call, q, k, v, *, deterministic):
        requested.append((direction, call.has_sinks, call.need_lse))
        return direction

    monkeypatch.setattr(plans, "sink_forward", lambda: setting)
    monkeypatch.setattr(plans, "graph_for", graph_for)
    q, call = _sink_call(packed=packed, needs_grad=True)
    plan = plans.build_plan(q, q, q, call, deterministic=False)
    forward = ("forward", True, False) if engine_first else ("forward", False, True)  # the fold needs the sink-less LSE
    assert requested == [forward, ("backward", True, False)] and plan.folds_sinks is not engine_first


def test_unknown_sink_forward_setting_is_named(monkeypatch):
    monkeypatch.setattr(plans, "_SINK_FORWARD", "fused")
    q, call = _sink_call(packed=True, needs_grad=False)
    with pytest.raises(ValueError, match="CUDNN_ATTENTION_SINK_FORWARD='fused'"):
        plans.build_plan(q, q, q, call, deterministic=False)
