"""A call cuDNN served is remembered by its arguments' signature, and the next call with that signature goes
straight to the kernels: here on the CPU, with resolve and kernel stood in for (``served_on_cpu``). The remembered
call must give the fresh call's result with its own per-call values (lengths, prefix sums), resolve again whenever
anything that decides the plan changes, and never be remembered when its inputs were changed on the way."""

import pytest
import torch

import cudnn_attention
from cudnn_attention import cudnn_graphs
from cudnn_attention import plan as plans
from cudnn_attention.graph_spec import GraphSpec
from cudnn_attention.masking import effective_lengths, make_mask_spec
from cudnn_attention.reference import dense_reference, varlen_reference
from support.graph_specs import graph_spec


def _dense(seed=0, B=2, H=4, H_kv=2, S=7, D=8):
    torch.manual_seed(seed)
    return torch.randn(B, H, S, D), torch.randn(B, H_kv, S, D), torch.randn(B, H_kv, S, D)


def test_a_remembered_dense_call_reads_its_own_lengths(served_on_cpu):
    q, k, v = _dense()
    sinks = torch.randn(4)
    mask = make_mask_spec(causal=True, bottom_right=True, window_size=(3, 0))
    for lengths_q, lengths_kv in (([7, 3], [7, 5]), ([2, 0], [6, 7])):  # same shapes, other values
        seqlens_q, seqlens_kv = torch.tensor(lengths_q), torch.tensor(lengths_kv)
        out = cudnn_attention.attention(
            q, k, v, causal=True, bottom_right=True, window_size=(3, 0), sinks=sinks, seqlens_q=seqlens_q, seqlens_kv=seqlens_kv
        )
        len_q, len_kv = effective_lengths(seqlens_q, seqlens_kv, 7, 7)
        want, _ = dense_reference(q, k, v, scale=8**-0.5, mask=mask, sinks_H=sinks, seqlens_q_B=len_q, seqlens_kv_B=len_kv)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert served_on_cpu["resolve"] == 1 and served_on_cpu["launch"] == 2


def test_a_remembered_packed_call_reads_its_own_prefix_sums(served_on_cpu):
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    mask = make_mask_spec(causal=True, bottom_right=False, window_size=(-1, -1))
    for bounds in ([0, 4, 9], [0, 1, 6]):  # same shapes, other documents (the second with a capacity tail)
        cu = torch.tensor(bounds, dtype=torch.int32)
        out = cudnn_attention.varlen_attention(q, k, v, cu, cu, 5, 5, causal=True)
        want, _ = varlen_reference(q, k, v, cu, cu, 5, 5, scale=8**-0.5, mask=mask)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert served_on_cpu["resolve"] == 1 and served_on_cpu["launch"] == 2
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 12 exceeds the 9 packed tokens"):  # still checked when remembered
        cudnn_attention.varlen_attention(q, k, v, torch.tensor([0, 4, 12], dtype=torch.int32), cu, 5, 5, causal=True)


@pytest.mark.parametrize(
    "change",
    ["needs grad", "deterministic", "sink forward", "dtype", "strides", "option", "lse"],
)
def test_what_decides_the_plan_resolves_again(served_on_cpu, monkeypatch, change):
    q, k, v = _dense()
    sinks = torch.randn(4)
    kwargs = dict(causal=True, sinks=sinks)
    cudnn_attention.attention(q, k, v, **kwargs)
    if change == "needs grad":
        q = q.clone().requires_grad_()
    elif change == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    elif change == "sink forward":
        monkeypatch.setattr(plans, "sink_forward", lambda: "fold")
    elif change == "dtype":
        q, k, v = q.double(), k.double(), v.double()
    elif change == "strides":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "option":
        kwargs["window_size"] = (2, 0)
    else:
        kwargs["return_lse"] = True
    cudnn_attention.attention(q, k, v, **kwargs)
    assert served_on_cpu["resolve"] == 2


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("why", ["subclass", "compiling", "validate", "head dim copied", "scale folded"])
def test_calls_that_are_not_remembered(served_on_cpu, monkeypatch, why):
    q, k, v = _dense()
    kwargs = {}
    if why == "subclass":
        q = q.as_subclass(_Subclass)
    elif why == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    elif why == "validate":
        kwargs["validate"] = True
    elif why == "head dim copied":
        q, k = torch.randn(2, 4, 7, 16)[..., ::2], torch.randn(2, 2, 7, 16)[..., ::2]
    else:
        kwargs["scale"] = -0.5  # served as 0.5 on -q
    first = cudnn_attention.attention(q, k, v, **kwargs)
    second = cudnn_attention.attention(q, k, v, **kwargs)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert served_on_cpu["resolve"] == 2


def _spec(n: int) -> GraphSpec:
    return graph_spec(heads_q=n, heads_kv=n, q_strides=(), k_strides=(), v_strides=(), o_strides=())


def test_memo_entries_go_with_their_graphs_and_stay_bounded(monkeypatch):
    cudnn_graphs.clear_cache()
    monkeypatch.setattr(cudnn_graphs, "build", lambda spec: f"graph {spec.heads_q}")
    monkeypatch.setattr(cudnn_graphs, "_CACHE_CAPACITY", 3)
    monkeypatch.setattr(cudnn_graphs, "_MEMO_CAPACITY", 4)
    try:
        for n in (1, 2, 3):
            cudnn_graphs.get_graph(_spec(n))
        cudnn_graphs.memoize("both", "plan of 1 and 2", (_spec(1), _spec(2)))
        cudnn_graphs.memoize("three", "plan of 3", (_spec(3),))
        assert cudnn_graphs.memoized("both") == "plan of 1 and 2"
        cudnn_graphs.get_graph(_spec(4))  # evicts graph 1, and with it every entry that holds it
        assert cudnn_graphs.memoized("both") is None and cudnn_graphs.memoized("three") == "plan of 3"
        cudnn_graphs.memoize("one again", "plan of 1", (_spec(1),))  # graph 1 is gone: nothing is kept for it
        assert cudnn_graphs.memoized("one again") is None
        for i in range(6):  # one graph, many keys (a packed call's token count changes every step)
            cudnn_graphs.memoize(("tokens", i), i, (_spec(3),))
        kept = [i for i in range(6) if cudnn_graphs.memoized(("tokens", i)) is not None]
        assert len(cudnn_graphs._by_call) == 4 and kept == [2, 3, 4, 5]  # the oldest went first, "three" among them
        assert cudnn_graphs._holders[_spec(3)] == {("tokens", i) for i in kept}  # forgotten ones are no longer listed
    finally:
        cudnn_graphs.clear_cache()
