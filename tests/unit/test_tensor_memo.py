"""What is derived from index tensors is kept on them only while it is still what they hold."""

import pytest
import torch

from cudnn_attention import tensor_memo


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
