"""A dense call whose batch passes cuDNN's grid limit is served as batch chunks that each fit (``batch_chunks``), and gives
what one call would: on the CPU with the limit lowered to 3 and resolve and kernel stood in for (``served_on_cpu``), a
chunked call's outputs, LSE, dQ, dK and dV equal the whole call's bit for bit (the sinks' gradient, summed over the
chunks, to float32 reassociation), in the whole call's memory layout. Calls the limit does not touch, or that cuDNN
cannot serve anyway, stay whole."""

import pytest
import torch

import cudnn_attention
from cudnn_attention import batch_chunks, errata
from cudnn_attention.call import AttentionCall, Prepared, padding_lengths
from support.leaf_gradients import projection_gradients

LIMIT = 3


@pytest.fixture
def limit_of_three(monkeypatch, served_on_cpu):
    """The grid limit lowered to 3, the CPU counted as a device cuDNN serves, the loaded cuDNN one with the limit."""
    monkeypatch.setattr(errata, "GRID_LIMIT", LIMIT)
    monkeypatch.setattr(batch_chunks, "grid_limited_on", lambda device_type: True)
    return served_on_cpu


def _leaves(B, *, H=2, H_kv=1, S_q=6, S_kv=9, D=8, bshd=False, seed=0):
    # Heads within the lowered limit (GQA 2:1). (B, S, H, D) memory seen as (B, H, S, D) when ``bshd``: transformers' layout,
    # which the output must keep.
    torch.manual_seed(seed)

    def make(heads, seq):
        if bshd:
            return torch.randn(B, seq, heads, D, dtype=torch.float16).transpose(1, 2).detach().requires_grad_()
        return torch.randn(B, heads, seq, D, dtype=torch.float16, requires_grad=True)

    q, k, v = make(H, S_q), make(H_kv, S_kv), make(H_kv, S_kv)
    sinks = torch.randn(H, requires_grad=True)
    return q, k, v, sinks


def _run(q, k, v, sinks, **options):
    out, lse = cudnn_attention.attention(q, k, v, sinks=sinks, return_lse=True, **options)
    return out, lse, projection_gradients(out, (q, k, v, sinks))


@pytest.mark.parametrize("bshd", [False, True], ids=["BHSD", "BSHD"])
@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True, bottom_right=True),
        dict(window_size=(2, 1), seqlens_q=torch.tensor([6, 0, 3, 5, 1, 6, 2]), seqlens_kv=torch.tensor([9, 4, 0, 7, 9, 2, 5])),
    ],
    ids=["causal", "padded band"],
)
def test_a_chunked_call_gives_the_whole_calls_results(limit_of_three, monkeypatch, bshd, options):
    q, k, v, sinks = _leaves(7, bshd=bshd)
    out, lse, grads = _run(q, k, v, sinks, **options)
    assert limit_of_three["launch"] == 3  # 7 rows past a limit of 3: three chunks, each launched on its own
    monkeypatch.setattr(errata, "GRID_LIMIT", 65535)
    whole_out, whole_lse, whole_grads = _run(q, k, v, sinks, **options)
    assert limit_of_three["launch"] == 4
    torch.testing.assert_close(out, whole_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=0)
    for name, got, want in zip(("dq", "dk", "dv"), grads, whole_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    # dSink is a float32 sum over every row of the batch, which the chunks regroup into three sums: equal up to the
    # reassociation of B x S_q terms (the recursive-summation bound, n float32 roundings).
    rows = q.shape[0] * q.shape[2]
    torch.testing.assert_close(grads[3], whole_grads[3], rtol=rows * torch.finfo(torch.float32).eps, atol=0)
    assert out.stride() == whole_out.stride() and lse.stride() == whole_lse.stride()


def test_chunks_are_at_most_one_row_apart_and_slice_the_lengths():
    q, k, v = torch.zeros(7, 2, 4, 8), torch.zeros(7, 1, 5, 8), torch.zeros(7, 1, 5, 8)
    lengths = padding_lengths(torch.arange(7), torch.arange(7) + 1, 7, 4, 5, "cpu")
    call = AttentionCall(packed=False, padded=True, max_seqlen_q=4, max_seqlen_kv=5, scale=1.0)
    parts = batch_chunks.chunks(Prepared(call, q, k, v, None, lengths, key=("whole",)), 3)
    assert [part.q.shape[0] for part in parts] == [3, 2, 2]
    assert [part.lengths.seqlens_kv.tolist() for part in parts] == [[1, 2, 3], [4, 5], [5, 5]]  # clamped to S_kv 5
    assert all(part.key is None and part.q.data_ptr() == q[i].data_ptr() for part, i in zip(parts, (0, 3, 5)))


def _prepared(B, *, H=2, H_kv=1, dtype=torch.float16, packed=False, device="cpu"):
    q = torch.zeros(B, H, 4, 8, dtype=dtype, device=device)
    k = torch.zeros(B, H_kv, 4, 8, dtype=dtype, device=device)
    call = AttentionCall(packed=packed, max_seqlen_q=4, max_seqlen_kv=4, scale=1.0)
    return Prepared(call, q, k, k, None, padding_lengths(None, None, B, 4, 4, device))


def test_only_calls_the_limit_stops_and_cudnn_could_serve_are_chunked(limit_of_three, monkeypatch):
    assert batch_chunks.chunk_count(_prepared(7)) == 3
    assert batch_chunks.chunk_count(_prepared(6)) == 2
    assert batch_chunks.chunk_count(_prepared(3)) == 1  # the limit itself runs
    assert batch_chunks.chunk_count(_prepared(7, H=4)) == 1  # heads past the limit: refused whole, no chunk helps
    assert batch_chunks.chunk_count(_prepared(7, packed=True)) == 1
    assert batch_chunks.chunk_count(_prepared(7, dtype=torch.float32)) == 1  # the exact path serves it whole anyway
    monkeypatch.setattr(batch_chunks, "grid_limited_on", lambda device_type: False)
    assert batch_chunks.chunk_count(_prepared(7)) == 1


def test_the_limit_applies_where_cudnn_serves_and_its_version_has_it(monkeypatch):
    monkeypatch.setattr(batch_chunks, "device_unservable_reason", lambda device: None)
    monkeypatch.setattr(batch_chunks, "cudnn_version", lambda: 91900)
    assert batch_chunks.grid_limited_on("cuda")
    fixed = [e._replace(fixed=92000) if e.key == "batch-or-heads-over-65535" else e for e in errata.ERRATA]
    monkeypatch.setattr(errata, "ERRATA", tuple(fixed))
    assert batch_chunks.grid_limited_on("cuda")  # 9.19 still has it
    monkeypatch.setattr(batch_chunks, "cudnn_version", lambda: 92000)
    assert not batch_chunks.grid_limited_on("cuda")  # a cuDNN without the limit takes the batch whole
    monkeypatch.setattr(batch_chunks, "cudnn_version", lambda: 91900)
    monkeypatch.setattr(batch_chunks, "device_unservable_reason", lambda device: "cpu tensors")
    assert not batch_chunks.grid_limited_on("cpu")


def test_without_a_gpu_a_large_batch_is_one_exact_call():
    # The real predicate on this machine: CPU tensors are never cuDNN's, whatever their batch.
    assert batch_chunks.chunk_count(_prepared(errata.GRID_LIMIT + 1, H=1)) == 1


def test_a_compiled_call_is_chunked_while_tracing_and_gives_the_eager_result(limit_of_three):
    q, k, v, sinks = (t.detach() for t in _leaves(7, bshd=True))
    eager = cudnn_attention.attention(q, k, v, sinks=sinks, causal=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *qkv: cudnn_attention.attention(*qkv, sinks=sinks, causal=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), eager, rtol=0, atol=0)
    assert limit_of_three["launch"] == 6  # three chunks each time


def test_the_predicate_is_read_once_while_tracing():
    # What a compiled graph runs: the real predicate, on a device this machine may or may not serve, without a break.
    compiled = torch.compile(lambda x: x + batch_chunks.grid_limited_on("cuda"), fullgraph=True, backend="eager")
    assert compiled(torch.zeros(())) == float(batch_chunks.grid_limited_on("cuda"))
