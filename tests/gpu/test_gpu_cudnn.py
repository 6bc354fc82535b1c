"""The cuDNN path on a GPU: accuracy against fp32, packing, sync-freedom, graphs, compile, determinism.

Tolerance rule (FlashAttention's): the cuDNN error against an fp32 reference may be at most twice
the error of PyTorch doing the same math in the input dtype, plus 1e-3 of the tensor's magnitude.
"""

import itertools

import pytest
import torch

import cudnn_attention
from cudnn_attention.reference import varlen_reference
from support.fill_spy import record_fills
from support.gpu_checks import check_against_references, check_dense, poison_allocator
from support.sync_debug import warm_and_run

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "bottom_right_decode": dict(causal=True, bottom_right=True),
    "left_window": dict(causal=True, window_size=(37, 0)),
    "left_right_window": dict(window_size=(29, 13)),
}
GRID = list(itertools.product(MASKS, (1, 4, 8), (64, 128), (torch.float16, torch.bfloat16)))
SINK_CASES = [("sinks", dict(causal=True)), ("sinks_window", dict(causal=True, window_size=(64, 0)))]


def _dense_case(mask_name, group, head_dim, dtype, sinks=False, seed=0):
    torch.manual_seed(seed)
    H = 8
    S_kv = 203
    S_q = 67 if mask_name == "bottom_right_decode" else S_kv
    q = torch.randn(2, S_q, H, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_()  # transformers' layout
    k = torch.randn(2, H // group, S_kv, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(2, H // group, S_kv, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    s = torch.randn(H, device=DEVICE, dtype=dtype, requires_grad=True) if sinks else None
    return q, k, v, s


@pytest.mark.parametrize("mask_name, group, head_dim, dtype", GRID)
def test_dense_matches_fp32_reference(mask_name, group, head_dim, dtype):
    check_dense(MASKS[mask_name], *_dense_case(mask_name, group, head_dim, dtype))


@pytest.mark.parametrize("name, options", SINK_CASES)
@pytest.mark.parametrize("group", (1, 8))
def test_dense_sinks_match_fp32_reference(name, options, group):
    check_dense(options, *_dense_case("causal", group, 64, torch.bfloat16, sinks=True))


def test_padded_dense_with_sinks_and_bottom_right():
    q, k, v, sinks = _dense_case("causal", 4, 64, torch.bfloat16, sinks=True)
    seqlens = (torch.tensor([203, 150], device=DEVICE), torch.tensor([203, 170], device=DEVICE))
    poison_allocator(q, k, v)
    out, grads = check_dense(dict(causal=True, bottom_right=True), q, k, v, sinks, seqlens)
    assert out[1, :, 150:].abs().max() == 0 and grads[0][1, :, 150:].abs().max() == 0
    assert grads[1][1, :, 170:].abs().max() == 0 and grads[2][1, :, 170:].abs().max() == 0
    assert all(torch.isfinite(g).all() for g in grads)


def _packed_case(lengths, group=4, head_dim=64, dtype=torch.bfloat16, sinks=False, tail=0, seed=0, q_lengths=None):
    torch.manual_seed(seed)
    H = 8
    q_lengths = q_lengths or lengths
    cu_q = torch.tensor([0, *itertools.accumulate(q_lengths)], device=DEVICE, dtype=torch.int32)
    cu_kv = torch.tensor([0, *itertools.accumulate(lengths)], device=DEVICE, dtype=torch.int32)
    T_q, T_kv = sum(q_lengths) + tail, sum(lengths) + tail
    q = torch.randn(T_q, H, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(T_kv, H // group, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(T_kv, H // group, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    s = torch.randn(H, device=DEVICE, dtype=torch.float32, requires_grad=True) if sinks else None
    return q, k, v, s, cu_q, cu_kv, max(q_lengths), max(lengths)


def _check_packed(options, q, k, v, sinks, cu_q, cu_kv, max_q, max_kv):
    return check_against_references(
        lambda *t, **kw: cudnn_attention.varlen_attention(*t, cu_q, cu_kv, max_q, max_kv, **kw),
        lambda *t, **kw: varlen_reference(*t, cu_q, cu_kv, max_q, max_kv, **kw),
        options,
        q,
        k,
        v,
        sinks,
    )


ODD_LENGTHS = [129, 1, 77, 300, 5]  # five documents (bucketed to six), a length-1 one among them


@pytest.mark.parametrize("mask_name, group, head_dim, dtype", GRID)
def test_packed_matches_fp32_reference(mask_name, group, head_dim, dtype):
    q_lengths = [min(n, 9) for n in ODD_LENGTHS] if mask_name == "bottom_right_decode" else None
    case = _packed_case(ODD_LENGTHS, group, head_dim, dtype, q_lengths=q_lengths)
    _check_packed(MASKS[mask_name], *case)


@pytest.mark.parametrize("name, options", SINK_CASES)
def test_packed_sinks_match_fp32_reference(name, options):
    _check_packed(options, *_packed_case(ODD_LENGTHS, group=8, sinks=True))


@pytest.mark.parametrize("sinks", [False, True])
def test_packed_head_major_inputs_get_right_gradients(sinks):
    # transformers' gpt-oss applies RoPE with torch.cat, so q and k arrive head-major: (T, H, D) views of (H, T, D)
    # memory. cuDNN's packed backward returned a wrong dQ for such a Q (relative error ~1 against fp32).
    q, k, v, s, cu_q, cu_kv, mq, mk = _packed_case(ODD_LENGTHS, sinks=sinks)
    q, k = (t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for t in (q, k))
    _check_packed(dict(causal=True, window_size=(40, 0)), q, k, v, s, cu_q, cu_kv, mq, mk)


def test_packed_empty_documents_and_capacity_tail_are_zero():
    q, k, v, sinks, cu_q, cu_kv, mq, mk = _packed_case([50, 0, 31, 0], sinks=True, tail=7)
    poison_allocator(q, k, v)
    out, grads = _check_packed(dict(causal=True), q, k, v, sinks, cu_q, cu_kv, mq, mk)
    assert out[-7:].abs().max() == 0
    assert all(g[-7:].abs().max() == 0 for g in grads[:3])
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("mask_name", ["none", "causal", "left_window", "left_right_window"])
@pytest.mark.parametrize("sinks", [False, True])
def test_packed_outputs_without_their_fill_are_written_in_every_row(mask_name, sinks, monkeypatch):
    # Prefix sums that cover every token, one tensor for q and kv (a transformers batch; an empty document
    # among them): O, the LSE and dQ/dK/dV are allocated without their zero fill, so any row the kernels left
    # unwritten would read the poison.

    q, k, v, s, cu, _, mq, mk = _packed_case([*ODD_LENGTHS, 0, 40], sinks=sinks)
    cudnn_attention.packed_batch(cu, cu, mq, mk, tokens_q=q.shape[0], tokens_kv=k.shape[0], cover_all=True)
    fills = record_fills(monkeypatch)
    poison_allocator(q, k, v, torch.empty(q.shape[:2], device=DEVICE))
    out, grads = _check_packed(MASKS[mask_name], q, k, v, s, cu, cu, mq, mk)
    assert fills == {"forward": [False], "backward": [False]}
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


def test_the_poison_shows_a_fill_skipped_where_rows_are_unwritten(monkeypatch):
    # The test above is only as good as its poison: with the fill wrongly skipped for a capacity tail, the tail reads it.
    monkeypatch.setattr(cudnn_attention.PackedBatch, "writes_every_row", lambda batch, mask: True)
    q, k, v, _, cu_q, cu_kv, mq, mk = _packed_case([50, 31], tail=7)
    poison_allocator(q, k, v)
    with torch.no_grad():
        out = cudnn_attention.varlen_attention(q, k, v, cu_q, cu_kv, mq, mk, causal=True)
    assert not torch.isfinite(out[-7:]).all()


@pytest.mark.parametrize("mask_name", ["causal", "left_window", "left_right_window"])
@pytest.mark.parametrize("sink_forward", [None, "fold", "engine"])
def test_one_prefix_sum_tensor_with_a_capacity_tail_sets_only_the_tail(mask_name, sink_forward, monkeypatch):
    # One tensor for both sides that stops short of the tokens (a fixed-size buffer): nothing is zero-filled first; the
    # tail is set after the kernels (packed_rows; with the fold, by the fold), so any other row the kernels left
    # unwritten would read the poison.
    from cudnn_attention import launch, plan

    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)  # this small case takes the pass, as a training step's does
    if sink_forward is not None:
        monkeypatch.setattr(plan, "sink_forward", lambda: sink_forward)
    q, k, v, s, cu, _, mq, mk = _packed_case([*ODD_LENGTHS, 0, 40], sinks=sink_forward is not None, tail=9)
    fills = record_fills(monkeypatch)
    poison_allocator(q, k, v, torch.empty(q.shape[:2], device=DEVICE))
    out, grads = _check_packed(MASKS[mask_name], q, k, v, s, cu, cu, mq, mk)
    assert fills == {"forward": [False], "backward": [False]}
    assert out[-9:].abs().max() == 0 and all(g[-9:].abs().max() == 0 for g in grads[:3])
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        _, lse = cudnn_attention.varlen_attention(q, k, v, cu, cu, mq, mk, return_lse=True, sinks=s, **MASKS[mask_name])
    assert lse[-9:].isneginf().all() and torch.isfinite(lse[:-9]).all()


@pytest.mark.parametrize("mask_name", ["causal", "bottom_right_decode", "left_window", "left_right_window"])
@pytest.mark.parametrize("sink_forward", [None, "fold", "engine"])
def test_two_prefix_sum_tensors_set_their_unwritten_rows_after_the_kernels(mask_name, sink_forward, monkeypatch):
    # Separate prefix sums for q and kv (transformers' flash kwargs): a document with keys and no query, one with
    # queries and no key, capacity tails on both sides, and documents whose sides differ in length (the masks then leave
    # query rows that see no key and keys no query sees: the kernels write those). Nothing is zero-filled first; the rows
    # the kernels leave unwritten are set after them (packed_rows.fill_rows), so any other unwritten row would read the
    # poison.
    from cudnn_attention import launch, plan

    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    if sink_forward is not None:
        monkeypatch.setattr(plan, "sink_forward", lambda: sink_forward)
    kv_lengths, q_lengths = [129, 1, 77, 300, 5, 0, 40], [64, 1, 0, 300, 9, 20, 80]
    q, k, v, s, cu_q, cu_kv, mq, mk = _packed_case(kv_lengths, sinks=sink_forward is not None, tail=9, q_lengths=q_lengths)
    fills = record_fills(monkeypatch)
    poison_allocator(q, k, v, torch.empty(q.shape[:2], device=DEVICE))
    out, grads = _check_packed(MASKS[mask_name], q, k, v, s, cu_q, cu_kv, mq, mk)
    assert fills == {"forward": [False], "backward": [False]}
    no_key, no_query = slice(374, 394), slice(130, 207)  # the sixth document's queries, the third one's keys
    assert out[no_key].abs().max() == 0 and grads[0][no_key].abs().max() == 0
    assert grads[1][no_query].abs().max() == 0 and grads[2][no_query].abs().max() == 0
    assert out[-9:].abs().max() == 0 and all(g[-9:].abs().max() == 0 for g in grads[:3])
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        _, lse = cudnn_attention.varlen_attention(q, k, v, cu_q, cu_kv, mq, mk, return_lse=True, sinks=s, **MASKS[mask_name])
    assert lse[no_key].isneginf().all() and lse[-9:].isneginf().all() and not lse.isnan().any()


def test_cudnn_leaves_unwritten_only_rows_the_passes_set():
    # The passes rest on what cuDNN leaves unwritten; benchmarks/unwritten_rows.py measures it (outputs preset to a
    # sentinel, no fill, no pass) over layouts, masks and sink forwards. A cuDNN that skips more rows fails here by name.
    from support.benchmark_scripts import run_script

    result = run_script("unwritten_rows", timeout=600)
    assert result.returncode == 0 and "covered everywhere: True" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


def test_the_poison_shows_rows_left_unset(monkeypatch):
    # The test above is only as good as its poison: with the pass after the kernels skipped, the rows read it.
    from cudnn_attention import launch

    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    monkeypatch.setattr(launch, "fill_rows", lambda fills: None)
    q, k, v, _, cu_q, cu_kv, mq, mk = _packed_case([50, 0, 31], tail=7, q_lengths=[50, 9, 31])
    poison_allocator(q, k, v)
    out = cudnn_attention.varlen_attention(q, k, v, cu_q, cu_kv, mq, mk, causal=True)
    out.backward(torch.randn_like(out))
    assert not torch.isfinite(out[50:59]).all() and not torch.isfinite(q.grad[-7:]).all()


def test_a_tail_that_grows_in_place_is_read_anew(monkeypatch):
    # The tail's start is read on the device at each launch: a loader that rewrites the prefix sums in place with
    # fewer tokens gets the new tail zeroed, with the same graphs.
    from cudnn_attention import launch

    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    q, k, v, _, cu, _, mq, mk = _packed_case(ODD_LENGTHS, tail=4)
    _check_packed(dict(causal=True), q, k, v, None, cu, cu, mq, mk)
    cu.copy_(torch.tensor([0, 129, 130, 207, 300, 305], dtype=cu.dtype))  # the fourth document shrinks to 93 tokens
    poison_allocator(q, k, v)
    out, grads = _check_packed(dict(causal=True), q, k, v, None, cu, cu, mq, mk)
    assert out[305:].abs().max() == 0 and all(g[305:].abs().max() == 0 for g in grads)


def test_the_poison_shows_a_tail_left_unset(monkeypatch):
    # The test above is only as good as its poison: with the pass after the kernels skipped, the tail reads it.
    from cudnn_attention import launch

    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    monkeypatch.setattr(launch, "fill_past_last_document", lambda cu, fills: None)
    q, k, v, _, cu, _, mq, mk = _packed_case([50, 31], tail=7)
    poison_allocator(q, k, v)
    out = cudnn_attention.varlen_attention(q, k, v, cu, cu, mq, mk, causal=True)
    out.backward(torch.randn_like(out))
    assert not torch.isfinite(out[-7:]).all() and not torch.isfinite(q.grad[-7:]).all()


def test_small_calls_keep_their_fills(monkeypatch):
    # Below _PASS_AFTER_MIN_ELEMENTS the fills stay (a host-bound call would pay the pass's launch): still exact.
    fills = record_fills(monkeypatch)
    q, k, v, _, cu, _, mq, mk = _packed_case([50, 31], tail=7)
    poison_allocator(q, k, v)
    out, grads = _check_packed(dict(causal=True), q, k, v, None, cu, cu, mq, mk)
    assert fills == {"forward": [True], "backward": [True]}
    assert out[-7:].abs().max() == 0 and all(g[-7:].abs().max() == 0 for g in grads)


def test_packed_documents_do_not_leak():
    q, k, v, sinks, cu_q, cu_kv, mq, mk = _packed_case([100, 60, 90], sinks=True)
    grad_out = torch.randn_like(q)

    def run(q_, k_, v_):
        leaves = [t.detach().clone().requires_grad_() for t in (q_, k_, v_, sinks)]
        out = cudnn_attention.varlen_attention(*leaves[:3], cu_q, cu_kv, mq, mk, causal=True, window_size=(40, 0), sinks=leaves[3])
        out.backward(grad_out)
        return out.detach(), [t.grad for t in leaves]

    base_out, base_grads = run(q, k, v)
    doc_a = slice(0, 100)
    q2, k2, v2 = q.detach().clone(), k.detach().clone(), v.detach().clone()
    for t in (q2, k2, v2):
        t[doc_a] = torch.randn_like(t[doc_a])
    out2, grads2 = run(q2, k2, v2)
    doc_b = slice(100, 250)
    assert not torch.equal(out2[doc_a], base_out[doc_a])
    assert torch.equal(out2[doc_b], base_out[doc_b]), "document B's output changed when only document A did"
    for name, g1, g2 in zip("qkv", base_grads, grads2):
        assert torch.equal(g1[doc_b], g2[doc_b]), f"d{name} of document B changed when only document A did"


@pytest.mark.parametrize("sink_forward", ["engine", "fold"])
def test_prefix_sums_rewritten_in_place_are_read_anew(monkeypatch, sink_forward):
    # Lengths and offsets derived from cu_seqlens are kept on the tensor for every layer and backward of a batch
    # (tensor_memo); a loader that writes the next batch into the same buffers must not get the old documents.
    from cudnn_attention import plan

    monkeypatch.setattr(plan, "sink_forward", lambda: sink_forward)
    q, k, v, sinks, cu_q, cu_kv, _, _ = _packed_case(ODD_LENGTHS, sinks=True, tail=4)
    _check_packed(dict(causal=True, window_size=(40, 0)), q, k, v, sinks, cu_q, cu_kv, 300, 300)
    cu_q.copy_(torch.tensor([0, 100, 300, 350, 380, 508], dtype=cu_q.dtype))  # same buffers and graphs, other documents
    cu_kv.copy_(torch.tensor([0, 100, 100, 350, 380, 508], dtype=cu_kv.dtype))  # document 1 has queries but no key
    out, _ = _check_packed(dict(causal=True, window_size=(40, 0)), q, k, v, sinks, cu_q, cu_kv, 300, 300)
    assert out[100:300].abs().max() == 0 and out[508:].abs().max() == 0


def test_no_host_sync_dense_and_packed():
    q, k, v, sinks = _dense_case("causal", 4, 128, torch.bfloat16, sinks=True)
    seqlens = torch.tensor([203, 100], device=DEVICE, dtype=torch.int32)

    def dense_step():
        cudnn_attention.attention(q, k, v, causal=True, sinks=sinks, seqlens_q=seqlens, seqlens_kv=seqlens).sum().backward()

    pq, pk, pv, ps, cu_q, cu_kv, mq, mk = _packed_case(ODD_LENGTHS, sinks=True, tail=3)

    def packed_step():
        cudnn_attention.varlen_attention(pq, pk, pv, cu_q, cu_kv, mq, mk, causal=True, window_size=(32, 0), sinks=ps).sum().backward()

    warm_and_run(dense_step)
    warm_and_run(packed_step)
    stats = cudnn_attention.stats()
    assert stats["cudnn_forward"] == 4 and stats["cudnn_backward"] == 4 and not stats["fallback_forward"]


@pytest.mark.parametrize("prefix_sums", ["one", "two"])
@pytest.mark.parametrize("sink_forward", [None, "fold", "engine"])
def test_no_host_sync_when_rows_are_set_after_the_kernels(prefix_sums, sink_forward, monkeypatch):
    # A training step's packed calls take the pass after the kernels (tail, or per-token masks with two prefix-sum
    # tensors); each step brings new prefix-sum tensors, so the per-batch derivations (lengths, masks) run again inside
    # the sync-checked call rather than being read back from the warm-up's memo.
    from cudnn_attention import launch, plan

    monkeypatch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    if sink_forward is not None:
        monkeypatch.setattr(plan, "sink_forward", lambda: sink_forward)
    q_lengths = ODD_LENGTHS if prefix_sums == "one" else [64, 1, 0, 300, 9]
    q, k, v, s, cu_q, cu_kv, mq, mk = _packed_case(ODD_LENGTHS, sinks=sink_forward is not None, tail=5, q_lengths=q_lengths)
    fills = record_fills(monkeypatch)

    def step():
        cu_q_batch = cu_q.clone()
        cu_kv_batch = cu_q_batch if prefix_sums == "one" else cu_kv.clone()
        out = cudnn_attention.varlen_attention(q, k, v, cu_q_batch, cu_kv_batch, mq, mk, causal=True, window_size=(32, 0), sinks=s)
        out.sum().backward()

    warm_and_run(step)
    assert fills == {"forward": [False, False], "backward": [False, False]}
    assert cudnn_attention.stats()["cudnn_backward"] == 2


def test_cuda_graph_capture_replays_eager_results():
    q, k, v, sinks, cu_q, cu_kv, mq, mk = _packed_case([64, 33, 100], sinks=True)
    static = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    grad_out = torch.randn_like(q)

    def step():
        for t in static:
            t.grad = None
        out = cudnn_attention.varlen_attention(*static[:3], cu_q, cu_kv, mq, mk, causal=True, sinks=static[3])
        out.backward(grad_out)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager_out = step().detach().clone()
    torch.cuda.current_stream().wait_stream(side)
    eager_grads = [t.grad.clone() for t in static]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    for t, fresh in zip(static, (q, k, v, sinks)):
        t.data.copy_(fresh.detach())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, eager_out)
    for name, t, g in zip(("dq", "dk", "dv", "dsinks"), static, eager_grads):
        assert torch.equal(t.grad, g), f"{name} differs between replay and eager"


def test_torch_compile_fullgraph_attention_block():
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(256, 3 * 256, bias=False)
            self.proj = torch.nn.Linear(256, 256, bias=False)
            self.sinks = torch.nn.Parameter(torch.randn(4))

        def forward(self, x_BSE):
            B, S, _ = x_BSE.shape
            q, k, v = self.qkv(x_BSE).view(B, S, 3, 4, 64).unbind(2)
            out = cudnn_attention.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, sinks=self.sinks)
            return self.proj(out.transpose(1, 2).reshape(B, S, 256))

    block = Block().to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 96, 256, device=DEVICE, dtype=torch.bfloat16)
    eager = block(x)
    eager.float().square().mean().backward()
    eager_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x)
    out.float().square().mean().backward()
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-2)
    for p, g in zip(block.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-2, atol=1e-2)
    assert cudnn_attention.stats()["cudnn_backward"] >= 2


def test_deterministic_backward_is_bit_identical():
    q, k, v, sinks, cu_q, cu_kv, mq, mk = _packed_case(ODD_LENGTHS, group=8, sinks=True)
    grad_out = torch.randn_like(q)
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out = cudnn_attention.varlen_attention(q, k, v, cu_q, cu_kv, mq, mk, causal=True, sinks=sinks)
            runs.append(torch.autograd.grad(out, (q, k, v, sinks), grad_out))
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), *runs):
        assert torch.equal(a, b), f"{name} differs between two deterministic backward passes"


def test_float32_cuda_falls_back_visibly_and_strict_raises():
    q, k, v, _ = _dense_case("causal", 1, 64, torch.bfloat16)
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    out = cudnn_attention.attention(q32, k32, v32, causal=True)
    assert cudnn_attention.stats()["fallback_forward"] == {"torch.float32 inputs (cuDNN attention runs float16/bfloat16)": 1}
    assert out.dtype == torch.float32
    with cudnn_attention.strict(), pytest.raises(cudnn_attention.StrictModeError, match="float32"):
        cudnn_attention.attention(q32, k32, v32, causal=True)


def test_configuration_cudnn_rejects_falls_back_exactly():
    # cuDNN refuses bottom-right causal masks with more queries than keys.
    torch.manual_seed(0)
    q = torch.randn(1, 4, 40, 64, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(1, 4, 24, 64, device=DEVICE, dtype=torch.bfloat16)
    out = cudnn_attention.attention(q, k, k, causal=True, bottom_right=True)
    reasons = cudnn_attention.stats()["fallback_forward"]
    assert len(reasons) == 1 and next(iter(reasons)).startswith("cuDNN rejected the forward graph")
    assert out[:, :, :16].abs().max() == 0 and torch.isfinite(out).all()
    cudnn_attention.attention(q, k, k, causal=True, bottom_right=True)
    assert next(iter(cudnn_attention.stats()["fallback_forward"].values())) == 2  # the verdict is cached, counted per call


def test_graph_builds_and_rejections_free_the_callers_tensors_without_the_gc():
    """A long-context fine-tuning step once kept its activations for two more steps (+4.5 GiB peak):
    frontend 1.32's plan creation leaves a frame cycle, which held every calling frame until the
    cyclic GC's next full pass. The shapes are that step's (one packed row, 9 documents, the longest
    16,384 tokens); the rejected configuration is the one above, its cached verdict raised twice."""
    import gc
    import weakref

    from cudnn_attention import cudnn_graphs

    def packed_step():
        torch.manual_seed(0)
        lengths = torch.tensor([16384, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096])
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(DEVICE, torch.int32)
        activation = torch.empty(2**28, device=DEVICE)  # 1 GiB standing for a forward's activations
        q = torch.randn(int(lengths.sum()), 16, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(int(lengths.sum()), 4, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        cudnn_attention.varlen_attention(q, k, v, cu, cu, 16384, 16384, causal=True).sum().backward()
        return weakref.ref(activation)

    def rejected_call():
        activation = torch.empty(2**28, device=DEVICE)
        q = torch.randn(1, 4, 40, 64, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(1, 4, 24, 64, device=DEVICE, dtype=torch.bfloat16)
        cudnn_attention.attention(q, k, k, causal=True, bottom_right=True)
        return weakref.ref(activation)

    cudnn_graphs.clear_cache()
    gc.collect()
    gc.disable()
    try:
        for call in (packed_step, rejected_call, rejected_call):
            activation = call()
            assert activation() is None, f"{call.__name__}: a frame of the call is still alive (a reference cycle or a kept traceback)"
        assert sum(cudnn_attention.stats()["fallback_forward"].values()) == 2  # the configuration was rejected, twice
    finally:
        gc.enable()


@pytest.mark.parametrize("sinks", [False, True])
def test_every_launch_path_gives_the_same_bits(monkeypatch, sinks):
    """The raw pointer array (the default), the frontend's uid map and the public ``pygraph.execute``; packed,
    dense and padded calls (their LSE, sinks and lengths go to the launch as they are, not viewed to 4-D)."""
    from cudnn_attention import _compat, cudnn_graphs

    q, k, v, s, cu_q, cu_kv, mq, mk = _packed_case(ODD_LENGTHS, sinks=sinks)
    dense = _dense_case("causal", 4, 64, torch.bfloat16, sinks=sinks)
    lengths = torch.tensor([203, 77], device=DEVICE, dtype=torch.int32)
    results = []
    for path in ("pointer array", "uid map", "public"):
        monkeypatch.setenv("CUDNN_ATTENTION_PUBLIC_EXECUTE", "1" if path == "public" else "0")
        if path == "uid map":
            monkeypatch.setattr(_compat, "backend_operand_uids", lambda graph: None)
        cudnn_graphs.clear_cache()
        out = cudnn_attention.varlen_attention(q, k, v, cu_q, cu_kv, mq, mk, causal=True, sinks=s)
        dense_out = cudnn_attention.attention(*dense[:3], causal=True, sinks=dense[3])
        padded_out = cudnn_attention.attention(*dense[:3], causal=True, sinks=dense[3], seqlens_q=lengths, seqlens_kv=lengths)
        inputs = [t for t in (q, k, v, s, *dense) if t is not None]
        outs = (out, dense_out, padded_out)
        results.append((*outs, *torch.autograd.grad(outs, inputs, tuple(torch.ones_like(o) for o in outs))))
        graphs = list(cudnn_graphs._cache.values())
        assert len(graphs) >= 4
        if path == "pointer array":
            assert all(g.pointer_order is not None for g in graphs), [g.spec.direction for g in graphs if g.pointer_order is None]
        else:
            assert all(g.pointer_order is None and (g.lowered is None) == (path == "public") for g in graphs)
    for a, b, c in zip(*results):
        assert torch.equal(a, b) and torch.equal(a, c)


CALLS = {
    "dense causal, grad": lambda d, p: (cudnn_attention.attention, d[:3], dict(causal=True)),
    "dense padded, sinks, window, grad": lambda d, p: (
        cudnn_attention.attention,
        d[:3],
        dict(
            causal=True,
            window_size=(50, 0),
            sinks=d[3],
            seqlens_q=torch.tensor([203, 90], device=DEVICE),
            seqlens_kv=torch.tensor([150, 0], device=DEVICE),
        ),
    ),
    "dense, no grad, lse": lambda d, p: (cudnn_attention.attention, [t.detach() for t in d[:3]], dict(return_lse=True)),
    "packed window sinks, grad": lambda d, p: (
        cudnn_attention.varlen_attention,
        [*p[:3], *p[4:]],
        dict(causal=True, window_size=(32, 0), sinks=p[3]),
    ),
    "packed, no grad": lambda d, p: (cudnn_attention.varlen_attention, [*(t.detach() for t in p[:3]), *p[4:]], dict(causal=True)),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_remembered_call_gives_the_fresh_calls_bits(monkeypatch, name):
    """The second call with one signature skips validation and plan resolution (it is remembered from the first)
    and must give the same outputs and gradients, bit for bit."""
    from cudnn_attention import cudnn_graphs
    from cudnn_attention import plan as plans

    fn, args, kwargs = CALLS[name](_dense_case("causal", 4, 64, torch.bfloat16, sinks=True), _packed_case(ODD_LENGTHS, sinks=True, tail=3))
    resolved = []
    resolve = plans.resolve
    monkeypatch.setattr(plans, "resolve", lambda *a: resolved.append(1) or resolve(*a))
    cudnn_graphs.clear_cache()
    results = []
    for _ in range(2):
        result = fn(*args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        inputs = [t for t in (*args[:3], kwargs.get("sinks")) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out)) if inputs else ()
        results.append((*(result if isinstance(result, tuple) else (result,)), *grads))
    assert len(resolved) == 1, "the second call resolved its plan again"
    assert cudnn_attention.stats()["cudnn_forward"] == 2 and not cudnn_attention.stats()["fallback_forward"]
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_kept_workspaces_are_per_stream():
    from cudnn_attention import cudnn_graphs, frontend

    q, k, v, _ = _dense_case("causal", 4, 64, torch.bfloat16)
    cudnn_graphs.clear_cache()
    want = cudnn_attention.attention(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = cudnn_attention.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    streams = {stream for _, stream in frontend._workspaces}
    assert {torch.cuda.current_stream().cuda_stream, side.cuda_stream} <= streams
    assert torch.equal(want, got)


def test_opcheck_forward_and_backward_ops():
    q, k, v, sinks, cu_q, cu_kv, mq, mk = _packed_case([40, 17])
    dq, dk, dv, ds = _dense_case("causal", 4, 64, torch.bfloat16, sinks=True)
    sinks32 = ds.detach().float().requires_grad_()
    torch.library.opcheck(
        torch.ops.cudnn_attention.forward.default, (dq, dk, dv, sinks32), dict(scale=0.125, window_right=0, need_lse=True)
    )
    options = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=mq, max_seqlen_kv=mk, scale=0.125, window_left=16, window_right=0)
    torch.library.opcheck(torch.ops.cudnn_attention.forward.default, (q, k, v), dict(options, need_lse=True))
