"""A packed batch is one value (``cudnn_attention.packed_batch``): built at its first call from its prefix sums, found
again by every later call with the same tensors, and gone with any in-place write to them. What it proves (the
prefix sums checked against which bounds, every token in a document) and what it derives (the kernels' lengths and
ragged offsets, the rows they leave unwritten) live in it, not on the caller's tensors."""

import pytest
import torch

import cudnn_attention
from cudnn_attention import validation
from cudnn_attention.call import packed_lengths
from cudnn_attention.masking import MaskSpec
from cudnn_attention.operands import absent_rows, ragged_operands
from cudnn_attention.packed_batch import registered_batch


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_one_value_per_batch_until_a_tensor_is_written():
    cu_q, cu_kv = _cu(0, 3, 8), _cu(0, 2, 8)
    facts = cudnn_attention.packed_batch(cu_q, cu_kv, 5, 6, tokens_q=8, tokens_kv=8).facts
    assert cudnn_attention.packed_batch(cu_q, cu_kv, 5, 6, tokens_q=8, tokens_kv=8).facts is facts
    assert registered_batch(cu_q, cu_kv, 8, 8).facts is facts and packed_lengths(cu_q, cu_kv, 8, 8).batch.facts is facts
    assert registered_batch(cu_q, cu_kv, 9, 9).facts is not facts  # other token counts: another batch
    assert registered_batch(cu_q, _cu(0, 2, 8), 8, 8).facts is not facts  # another partner object, equal contents or not
    cu_kv.add_(0)  # an in-place write is a new version: a new batch
    assert registered_batch(cu_q, cu_kv, 8, 8).facts is not facts
    assert not vars(cu_q)  # nothing was set on the caller's tensor


@pytest.mark.parametrize("flag", ["cover_all", "validate"])
def test_its_flags_are_bools(flag):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got 'no' \(str\)"):
        cudnn_attention.packed_batch(cu, cu, 4, 4, tokens_q=4, tokens_kv=4, **{flag: "no"})


def test_the_kept_facts_leave_with_their_tensors():
    import gc
    import weakref

    from cudnn_attention import tensor_memo

    cu = _cu(0, 3, 8)
    cudnn_attention.packed_batch(cu, cu, 5, 5, tokens_q=8, tokens_kv=8, cover_all=True)
    owner = weakref.ref(cu)
    held = len(tensor_memo._tables)
    del cu
    gc.collect()
    assert owner() is None and len(tensor_memo._tables) == held - 1  # the facts kept nothing alive


def test_covering_every_token_is_proved_by_a_check_of_one_tensor_that_ends_at_the_token_count():
    cu = _cu(0, 3, 8)
    assert not cudnn_attention.packed_batch(cu, cu, 5, 5, tokens_q=8, tokens_kv=8).covers_every_token  # ends within: not enough
    covered = cudnn_attention.packed_batch(cu, cu, 5, 5, tokens_q=8, tokens_kv=8, cover_all=True)
    assert covered.covers_every_token and registered_batch(cu, cu, 8, 8).covers_every_token
    two = _cu(0, 3, 8), _cu(0, 3, 8)  # each covers every token, but kv's documents could differ from q's
    assert not cudnn_attention.packed_batch(*two, 5, 5, tokens_q=8, tokens_kv=8, cover_all=True).covers_every_token
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 7 leaves tokens 7..7"):
        cudnn_attention.packed_batch(_cu(0, 3, 7), _cu(0, 3, 7), 5, 5, tokens_q=8, tokens_kv=8, cover_all=True)
    cu[2] = 7  # a capacity tail now: the proof is gone with the version
    assert not registered_batch(cu, cu, 8, 8).covers_every_token


def test_the_rows_left_unwritten_follow_the_batch_and_the_mask():
    cu = _cu(0, 3, 8)
    covered = cudnn_attention.packed_batch(cu, cu, 5, 5, tokens_q=8, tokens_kv=8, cover_all=True)
    tail = cudnn_attention.packed_batch(_cu(0, 3, 7), _cu(0, 3, 7), 5, 5, tokens_q=8, tokens_kv=8)
    one_tail = _cu(0, 3, 7)
    one = cudnn_attention.packed_batch(one_tail, one_tail, 5, 5, tokens_q=8, tokens_kv=8)
    causal, never_the_diagonal = MaskSpec(-1, 0), MaskSpec(-1, 0)._replace(left=-2)  # a mask kind that drops the diagonal
    assert covered.writes_every_row(causal) and not covered.writes_every_row(never_the_diagonal)
    assert one.leaves_only_a_tail(causal) and not one.leaves_only_a_tail(never_the_diagonal)
    assert not tail.leaves_only_a_tail(causal)  # two tensors: documents without keys too


def test_checks_run_once_per_bounds_and_a_stricter_one_stands_for_the_plain(monkeypatch):
    ran = []
    check = validation.check_prefix_sums
    monkeypatch.setattr(validation, "check_prefix_sums", lambda *args, **kwargs: ran.append(kwargs["cover_all"]) or check(*args, **kwargs))
    cu = _cu(0, 3, 8)
    for _ in range(3):  # every layer of a forward
        cudnn_attention.packed_batch(cu, cu, 5, 5, tokens_q=8, tokens_kv=8, cover_all=True)
        cudnn_attention.packed_batch(cu, cu, 5, 5, tokens_q=8, tokens_kv=8)
    assert ran == [True]
    cudnn_attention.packed_batch(cu, cu, 6, 6, tokens_q=8, tokens_kv=8)  # other bounds: checked again
    assert ran == [True, False]


def test_derived_operands_are_made_once_per_batch_and_anew_after_a_write():
    class Graph:  # what _ragged_operands reads of a CompiledGraph
        batch, ragged_columns = 4, (("q", 256), ("kv", 64))

    cu_q, cu_kv = _cu(0, 3, 3, 8), _cu(0, 2, 4, 4)
    batch = registered_batch(cu_q, cu_kv, 8, 4)
    calls = []

    def compute():
        calls.append(1)
        return ragged_operands(Graph, cu_q, cu_kv)

    first = batch.derived(("ragged operands", 4), compute)
    batch = registered_batch(cu_q, cu_kv, 8, 4)  # the next layer's call: what the first derived is there
    assert batch.derived(("ragged operands", 4), compute) is first and len(calls) == 1
    len_q, len_kv, offsets_q, offsets_kv = (t.view(-1).tolist() for t in first)
    # Bucketed to 4 documents (one trailing empty); document 2 has queries but no key, so no query rows.
    assert len_q == [3, 0, 0, 0] and len_kv == [2, 2, 0, 0]
    assert offsets_q == [0, 768, 768, 2048, 2048] and offsets_kv == [0, 128, 256, 256, 256]
    absent_q, absent_kv = absent_rows(batch)
    assert absent_q.view(-1).tolist() == [False] * 3 + [True] * 5 and absent_kv.view(-1).tolist() == [False, False, True, True]
    cu_kv[3] = 5  # the next batch written into the same buffer
    again = registered_batch(cu_q, cu_kv, 8, 4)
    assert again.facts is not batch.facts and again.derived(("ragged operands", 4), compute)[1].view(-1).tolist() == [2, 2, 1, 0]


def test_packing_from_position_ids_proves_its_prefix_sums_cover_every_token():
    pytest.importorskip("transformers")
    from cudnn_attention.integrations.hf.attention_function import _packing_from_position_ids

    (cu_q, cu_k), _ = _packing_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]), 1, 9, 9)
    assert cu_q is cu_k and registered_batch(cu_q, cu_k, 9, 9).covers_every_token
