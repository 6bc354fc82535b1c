"""What is derived from index tensors is kept on them only while it is still what they hold."""

import pytest
import torch

from cudnn_attention import tensor_memo
from cudnn_attention.launch import _memoized, _ragged_operands


def test_a_kept_value_is_dropped_by_any_write_to_its_tensors():
    cu_q, cu_kv = torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8])
    assert tensor_memo.recall(cu_q, "k", cu_kv) is None
    tensor_memo.remember(cu_q, "k", "value", cu_kv)
    assert tensor_memo.recall(cu_q, "k", cu_kv) == "value"
    assert tensor_memo.recall(cu_q, "other key", cu_kv) is None
    assert tensor_memo.recall(cu_q, "k", torch.tensor([0, 3, 8])) is None  # another partner object, equal contents or not
    cu_kv.add_(0)  # an in-place write to the partner is a new version
    assert tensor_memo.recall(cu_q, "k", cu_kv) is None
    tensor_memo.remember(cu_q, "k", "value", cu_kv)
    cu_q[1] = 4  # and so is one to the owner
    assert tensor_memo.recall(cu_q, "k", cu_kv) is None


def test_inference_tensors_keep_nothing_and_raise_nothing():
    # Inference tensors have no version counter (reading t._version raises): the caches used to read it.
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 8])
        tensor_memo.remember(cu, "k", "value", cu)
        assert tensor_memo.recall(cu, "k", cu) is None


def test_packing_from_position_ids_works_on_inference_tensors():
    pytest.importorskip("transformers")
    from cudnn_attention.integrations.hf.attention_function import _packing_from_position_ids

    with torch.inference_mode():
        position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
        (cu_q, cu_k), (max_q, max_k) = _packing_from_position_ids(position_ids, 1, 9, 9)
    assert cu_q.tolist() == [0, 3, 5, 9] and max_q == max_k == 4


class _Graph:  # what _ragged_operands reads of a CompiledGraph
    def __init__(self, batch, ragged_columns):
        self.batch, self.ragged_columns = batch, ragged_columns


def test_ragged_operands_are_computed_once_per_tensor_version():
    cu_q, cu_kv = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 2, 4, 4], dtype=torch.int32)
    graph = _Graph(batch=4, ragged_columns=(("q", 256), ("kv", 64)))
    calls = []

    def compute():
        calls.append(1)
        return _ragged_operands(graph, cu_q, cu_kv)

    key = ("ragged operands", graph.batch, graph.ragged_columns)
    first = _memoized(cu_q, cu_kv, key, compute)
    assert _memoized(cu_q, cu_kv, key, compute) is first and len(calls) == 1
    len_q, len_kv, offsets_q, offsets_kv = (t.view(-1).tolist() for t in first)
    # Bucketed to 4 documents (one trailing empty); document 2 has queries but no key, so no query rows.
    assert len_q == [3, 0, 0, 0] and len_kv == [2, 2, 0, 0]
    assert offsets_q == [0, 768, 768, 2048, 2048] and offsets_kv == [0, 128, 256, 256, 256]
    cu_kv[3] = 5  # the next batch written into the same buffer
    again = _memoized(cu_q, cu_kv, key, compute)
    assert len(calls) == 2 and again[1].view(-1).tolist() == [2, 2, 1, 0]


def test_every_token_covered_is_known_only_while_the_prefix_sums_are_what_was_checked():
    from cudnn_attention import validation

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert not validation.every_token_covered(cu, cu, 8, 8)  # never checked
    validation.check_prefix_sums(cu, cu, 8, 8, 5, 5, validate=False)  # ends within the tokens: not enough
    assert not validation.every_token_covered(cu, cu, 8, 8)
    validation.check_prefix_sums(cu, cu, 8, 8, 5, 5, validate=False, cover_all=True)
    assert validation.every_token_covered(cu, cu, 8, 8)
    assert not validation.every_token_covered(cu, cu, 9, 9)  # other token counts
    cu[2] = 7  # a capacity tail now: the fact is gone with the version
    assert not validation.every_token_covered(cu, cu, 8, 8)
    tail = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="leaves tokens 7..7"):
        validation.check_prefix_sums(tail, tail, 8, 8, 5, 5, validate=False, cover_all=True)
    assert not validation.every_token_covered(tail, tail, 8, 8)


def test_packing_from_position_ids_knows_its_prefix_sums_cover_every_token():
    pytest.importorskip("transformers")
    from cudnn_attention import validation
    from cudnn_attention.integrations.hf.attention_function import _packing_from_position_ids

    (cu_q, cu_k), _ = _packing_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]), 1, 9, 9)
    assert cu_q is cu_k and validation.every_token_covered(cu_q, cu_k, 9, 9)


@pytest.mark.parametrize("case", ["covered", "tail", "two tensors", "kv tokens differ"])
def test_packed_outputs_skip_their_zero_fill_only_when_the_kernel_writes_every_row(case):
    from cudnn_attention import validation
    from cudnn_attention.call import packed_lengths

    q = torch.empty(8, 2, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_kv, k = cu, q
    if case == "tail":
        cu = cu_kv = torch.tensor([0, 3, 7], dtype=torch.int32)
    elif case == "two tensors":  # each covers every token, but kv's documents could differ from q's
        cu_kv = cu.clone()
        validation.note_every_token_covered(cu, cu, q.shape[0], k.shape[0])
    elif case == "kv tokens differ":
        k = torch.empty(9, 2, 4)
    if case not in ("tail", "two tensors"):
        validation.note_every_token_covered(cu, cu_kv, q.shape[0], k.shape[0])
    assert packed_lengths(cu, cu_kv, q.shape[0], k.shape[0]).covers_every_token is (case == "covered")
