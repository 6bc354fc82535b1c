"""A call whose backward passes cuDNN's element limit (2**31: errata entry ``backward-past-2**31-elements``) is served
as groups of heads that each stay below (``head_groups``), and gives what one call would: on the CPU with the limit
lowered and resolve and kernel stood in for (``served_on_cpu``), a grouped call's outputs, LSE, dQ, dK, dV and dSink
equal the whole call's, dense (both memory layouts) and packed, in the whole call's layout. Calls the limit does not
touch, that run no backward, or that cuDNN cannot serve anyway, stay whole; so does one no grouping brings below, whose
backward graph the table refuses."""

import re

import pytest
import torch

import cudnn_attention
from cudnn_attention import errata, head_groups
from cudnn_attention.call import AttentionCall, Prepared, padding_lengths
from cudnn_attention.layouts import split_evenly
from support.benchmark_scripts import run_script
from support.child_process import succeeded
from support.graph_specs import graph_spec
from support.leaf_gradients import projection_gradients

V919, V928 = 91900, 92801


@pytest.fixture
def small_limit(monkeypatch, served_on_cpu):
    """The element limit lowered to 1,200, the CPU counted as a device cuDNN serves, the loaded cuDNN one with the entry."""
    monkeypatch.setattr(errata, "ELEMENT_LIMIT", 1200)
    monkeypatch.setattr(head_groups, "element_limited_on", lambda device_type: True)
    return served_on_cpu


def _dense(*, bshd=False, H=8, H_kv=4, B=2, S=12, D=8, seed=0):
    # B x S x H x D = 1,536 elements of q, past 1,200; half the heads (768) within it.
    torch.manual_seed(seed)

    def make(heads):
        if bshd:
            return torch.randn(B, S, heads, D, dtype=torch.float16).transpose(1, 2).detach().requires_grad_()
        return torch.randn(B, heads, S, D, dtype=torch.float16, requires_grad=True)

    return make(H), make(H_kv), make(H_kv), torch.randn(H, requires_grad=True)


def _packed(*, H=8, H_kv=4, D=8, seed=0):
    # 24 tokens bucket to 64 rows: 64 x 8 x 8 = 4,096 past 1,200, 64 x 2 x 8 = 1,024 within it: four groups.
    torch.manual_seed(seed)
    T = 24
    leaves = [torch.randn(T, heads, D, dtype=torch.float16, requires_grad=True) for heads in (H, H_kv, H_kv)]
    return (*leaves, torch.randn(H, requires_grad=True))


def _run(q, k, v, sinks, packed, **options):
    if packed:
        cu = torch.tensor([0, 5, 5, 17, 24], dtype=torch.int32)
        out, lse = cudnn_attention.varlen_attention(q, k, v, cu, cu, 12, 12, sinks=sinks, return_lse=True, **options)
    else:
        out, lse = cudnn_attention.attention(q, k, v, sinks=sinks, return_lse=True, **options)
    return out, lse, projection_gradients(out, (q, k, v, sinks))


@pytest.mark.parametrize(
    "leaves, packed, groups",
    [
        (lambda: _dense(), False, 2),
        (lambda: _dense(bshd=True), False, 2),
        (lambda: _packed(), True, 4),
    ],
    ids=["BHSD", "BSHD", "packed"],
)
@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(3, 1))], ids=["causal", "band"])
def test_a_grouped_call_gives_the_whole_calls_results(small_limit, monkeypatch, leaves, packed, groups, options):
    q, k, v, sinks = leaves()
    out, lse, grads = _run(q, k, v, sinks, packed, **options)
    assert small_limit["launch"] == groups  # each group launched on its own
    monkeypatch.setattr(errata, "ELEMENT_LIMIT", 2**31)
    whole_out, whole_lse, whole_grads = _run(q, k, v, sinks, packed, **options)
    assert small_limit["launch"] == groups + 1
    torch.testing.assert_close(out, whole_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=0)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, whole_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert out.stride() == whole_out.stride() and lse.stride() == whole_lse.stride()


@pytest.mark.parametrize(
    "leaves, packed, groups",
    [
        (lambda: _dense(H_kv=1), False, 2),  # MQA: two groups of four query heads share the one kv head
        (lambda: _dense(bshd=True, H_kv=1), False, 2),
        (lambda: _packed(H_kv=1), True, 4),  # four groups of two share it
        (lambda: _packed(H_kv=2), True, 4),  # GQA whose one kv head's share (2,048) is past it: two groups per kv head
    ],
    ids=["MQA-BHSD", "MQA-BSHD", "MQA-packed", "GQA-packed"],
)
def test_groups_that_share_a_kv_head_give_the_whole_calls_results(small_limit, monkeypatch, leaves, packed, groups):
    q, k, v, sinks = leaves()
    out, lse, grads = _run(q, k, v, sinks, packed, causal=True)
    assert small_limit["launch"] == groups
    monkeypatch.setattr(errata, "ELEMENT_LIMIT", 2**31)
    whole_out, whole_lse, whole_grads = _run(q, k, v, sinks, packed, causal=True)
    assert small_limit["launch"] == groups + 1
    torch.testing.assert_close(out, whole_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=0)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, whole_grads):
        # A shared kv head's dK and dV are the sum of its groups' gradients, each rounded to float16 by its own
        # kernel: within a float16 rounding of the whole call's, which rounds the sum once. The rest is per query head.
        shared = name in ("dk", "dv")
        atol = torch.finfo(torch.float16).eps * want.abs().max().item() if shared else 0
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def test_groups_that_share_a_kv_head_hold_the_same_tensor():
    # One copy of a kv head serves every group that reads it, so a packed kv head is copied once, and the provider's
    # backward (joined_gradients) finds the groups whose dK and dV it adds up.
    q, k, v, sinks = (t.detach() for t in _packed(H=8, H_kv=2))
    call = AttentionCall(packed=True, max_seqlen_q=12, max_seqlen_kv=12, scale=1.0)
    parts = head_groups.groups(Prepared(call, q, k, v, sinks, None), 4)
    assert [(part.q.shape[1], part.k.shape[1]) for part in parts] == [(2, 1)] * 4
    assert parts[0].k is parts[1].k and parts[2].v is parts[3].v and parts[1].k is not parts[2].k
    torch.testing.assert_close(parts[3].k, k[:, 1:], rtol=0, atol=0)
    torch.testing.assert_close(parts[3].q, q[:, 6:], rtol=0, atol=0)


def test_the_providers_join_adds_shared_kv_gradients_in_float32():
    # Three groups share the one kv head: their float16 dK add up in float32, rounded once. Summed in float16, each
    # addition would round: 1 + 2**-11 + 2**-11 gives 1 that way, 1 + 2**-10 this way.
    q, k, v, sinks = (t.detach() for t in _packed(H=6, H_kv=1))
    call = AttentionCall(packed=True, max_seqlen_q=12, max_seqlen_kv=12, scale=1.0)
    parts = head_groups.groups(Prepared(call, q, k, v, None, None), 3)
    ones = torch.ones(24, 1, 8, dtype=torch.float16)
    results = [(torch.zeros(24, 2, 8, dtype=torch.float16), ones * step, ones * step, None) for step in (1, 2**-11, 2**-11)]
    dq, dk, dv, dsinks = head_groups.joined_gradients(parts, results)
    assert dq.shape == (24, 6, 8) and dsinks is None
    for summed in (dk, dv):
        assert summed.shape == (24, 1, 8) and summed.dtype == torch.float16
        assert torch.equal(summed, torch.full_like(summed, 1 + 2**-10))


def test_groups_are_views_each_with_the_kv_heads_its_queries_read():
    q, k, v, sinks = (t.detach() for t in _dense(H=8, H_kv=2))
    call = AttentionCall(packed=False, max_seqlen_q=12, max_seqlen_kv=12, scale=1.0)
    parts = head_groups.groups(Prepared(call, q, k, v, sinks, padding_lengths(None, None, 2, 12, 12, "cpu"), key=("whole",)), 2)
    # Query head i reads kv head i // 4: heads 0-3 and kv head 0, heads 4-7 and kv head 1.
    assert [(part.q.shape[1], part.k.shape[1], part.v.shape[1], part.sinks.shape[0]) for part in parts] == [(4, 1, 1, 4)] * 2
    assert parts[1].q.data_ptr() == q[:, 4].data_ptr() and parts[1].k.data_ptr() == k[:, 1].data_ptr()
    assert parts[1].sinks.data_ptr() == sinks[4:].data_ptr() and all(part.key is None for part in parts)


def test_packed_groups_are_compact_copies_of_their_heads():
    # As views a group's heads are interleaved with the others' (token stride H x D): cuDNN 9.19's packed backward then
    # gave a wrong dQ on an H200. Only compact token-major operands are read right (layouts.token_major).
    q, k, v, sinks = (t.detach() for t in _packed(H=8, H_kv=4))
    call = AttentionCall(packed=True, max_seqlen_q=12, max_seqlen_kv=12, scale=1.0)
    parts = head_groups.groups(Prepared(call, q, k, v, sinks, None), 2)
    assert all(t.is_contiguous() for part in parts for t in (part.q, part.k, part.v))
    for got, want in ((parts[1].q, q[:, 4:]), (parts[1].k, k[:, 2:]), (parts[1].v, v[:, 2:]), (parts[0].q, q[:, :4])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("count", [2, 3])
def test_pieces_are_cut_as_tensor_split_cuts_under_one_autograd_node(count):
    # One node: its backward is one concatenation, where tensor_split's slices each build a zero-filled whole.
    t = torch.randn(2, 7, 3, requires_grad=True)
    parts = split_evenly(t, count, 1)
    for got, want in zip(parts, torch.tensor_split(t, count, 1), strict=True):
        assert got.shape == want.shape and got.data_ptr() == want.data_ptr()
    assert all(part.grad_fn is parts[0].grad_fn for part in parts), [part.grad_fn for part in parts]


def _prepared(*, B=2, H=8, H_kv=4, S=12, D=8, dtype=torch.float16, needs_grad=True, packed=False):
    # Broadcast views: the shapes are what is asked, and a call past 2**31 elements would not fit in memory.
    q = torch.zeros((), dtype=dtype).expand(B, H, S, D)
    k = torch.zeros((), dtype=dtype).expand(B, H_kv, S, D)
    call = AttentionCall(packed=packed, max_seqlen_q=S, max_seqlen_kv=S, scale=1.0, needs_grad=needs_grad)
    return Prepared(call, q, k, k, None, padding_lengths(None, None, B, S, S, "cpu"))


def test_the_fewest_groups_that_fit_and_only_where_the_limit_applies(small_limit, monkeypatch):
    assert head_groups.group_count(_prepared()) == 2  # 1,536 elements: two groups of 768
    assert head_groups.group_count(_prepared(S=24)) == 4  # 3,072: two groups of 1,536 would not fit
    assert head_groups.group_count(_prepared(S=6)) == 1  # 768: within it
    assert head_groups.group_count(_prepared(needs_grad=False)) == 1  # the forward was right past the limit
    assert head_groups.group_count(_prepared(dtype=torch.float32)) == 1  # the exact path serves it whole anyway
    # H_kv 1 (MQA): the one kv head's queries in two groups that share it.
    assert head_groups.group_count(_prepared(H=8, H_kv=1)) == 2
    # One kv head's share (3,072) still past it: each kv head's queries in four groups of one (768).
    assert head_groups.group_count(_prepared(S=48, H_kv=2)) == 8
    assert head_groups.group_count(_prepared(S=48, H=6, H_kv=2)) == 6  # 3 and 4 groups would cut a kv head's share unevenly
    # One query head (1,536) still past it: no grouping brings it below, so the call stays whole and the table refuses
    # its backward.
    assert head_groups.group_count(_prepared(S=96, H_kv=1)) == 1
    monkeypatch.setattr(head_groups, "element_limited_on", lambda device_type: False)
    assert head_groups.group_count(_prepared()) == 1


def test_the_table_refuses_a_backward_graph_past_the_limit_on_the_versions_it_names():
    past = graph_spec(direction="backward", batch=1, heads_q=64, heads_kv=8, seq_q=786432, seq_kv=786432, dim_qk=64, dim_v=64)
    packed_past = graph_spec(
        direction="backward", packed=True, batch=1024, heads_q=64, heads_kv=8, seq_q=1024, seq_kv=1024, total_q=786432, total_kv=786432
    )
    half = packed_past._replace(heads_q=32, heads_kv=4)
    for spec in (past, packed_past):
        erratum = errata.matching(spec, V919)
        assert erratum is not None and erratum.key == "backward-past-2**31-elements" and erratum.action == errata.REFUSE
        assert errata.matching(spec, V928) is None
        assert errata.matching(spec._replace(direction="forward", total_q=0, total_kv=0), V919) is None
    assert errata.matching(half, V919) is None
    assert errata.element_limited(V919) and errata.element_limited(None) and not errata.element_limited(V928)


def test_without_a_gpu_a_call_past_the_limit_is_one_exact_call():
    # The real predicate on this machine: CPU tensors are never cuDNN's, whatever their size.
    assert head_groups.group_count(_prepared(S=2**25)) == 1


def test_the_element_limit_probe_runs_on_the_cpu():
    # benchmarks/element_limit_probe.py, the diagnosis behind the entry, at a small size: its four variants, each
    # document's error over the bound (the exact path against the reference: within it).
    said = succeeded(run_script("element_limit_probe", "3", "64", "4", "2", timeout=300))
    variants = [line for line in said.splitlines() if "fallbacks" in line]
    ratios = [float(value) for value in re.findall(r"(?:out|dq|dk|dv) +([0-9.]+)", said)]
    assert len(variants) == 4 and len(ratios) == 4 * 3 * 4 and max(ratios) <= 1, said
