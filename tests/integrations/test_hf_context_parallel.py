"""transformers with context parallelism: tiny Mistral-like (sliding window) and gpt-oss-like (sinks, alternating window)
models on 2 gloo processes against one process, the batch helper, and what the ``"cudnn"`` layer refuses under it.

The two-process cases run once for the module (``support.cp_launch.run_suite("hf", 2)``, ``support.cp_hf_cases``): the
loss averaged over the group and every parameter's gradient averaged over it (``average_gradients``) equal the
single-process step's within float32 rounding. On 4 processes, a (dp, cp) mesh of 2 x 2 with DDP or FSDP2 over every rank
gives the data-parallel step's gradient (``run_suite("hf_mesh", 4)``).
"""

from __future__ import annotations

import sys

import pytest
import torch

from cudnn_attention import context_parallel
from cudnn_attention.integrations.hf import cudnn_attention_forward, shard_batch_for_context_parallel
from support.cp_hf_cases import HF_CASES
from support.cp_launch import run_suite

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo process groups")
TOLERANCE = 64 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def results():
    return run_suite("hf", 2)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_loss_and_gradients_with_two_ranks_equal_one_process(results, case):
    for rank, result in enumerate(results[case]):
        for quantity in ("loss", "grads"):
            error, magnitude = result[quantity]
            assert error <= TOLERANCE * max(magnitude, 1.0), (
                f"rank {rank}: {quantity} off by {error:.3g} (|ref| {magnitude:.3g}, {result['worst']})"
            )
        assert result["sinks_trained"] == case.startswith("gpt_oss")  # the sinks' gradients are among those compared


@pytest.fixture(scope="module")
def mesh_results():
    return run_suite("hf_mesh", 4)


@pytest.mark.parametrize("case", ["mistral-ddp", "mistral-fsdp2", "gpt_oss-ddp", "gpt_oss-fsdp2"])
def test_ddp_and_fsdp2_over_a_dp_by_cp_mesh_give_the_data_parallel_gradient(mesh_results, case):
    # 2 dp rows x 2 cp ranks, each dp row its own batch; DDP or FSDP2 over all four ranks averages every gradient.
    for rank, result in enumerate(mesh_results[case]):
        error, magnitude = result["grads"]
        assert error <= TOLERANCE * max(magnitude, 1.0), f"rank {rank}: {result['worst']} off by {error:.3g} (|ref| {magnitude:.3g})"
        assert result["compared"] >= 21  # every parameter of the model, the sinks among them for gpt-oss


def test_the_lightning_helper_takes_the_tensor_parallel_row_of_model_parallel_strategys_mesh(results):
    assert [result["ranks"] for result in results["lightning_mesh"]] == [[0, 1], [0, 1]]


# ----------------------------------------------------------------------------------------------
# In one process: the batch helper and the layer's refusals
# ----------------------------------------------------------------------------------------------


def test_the_batch_helper_packs_pads_shifts_and_shards():
    from support.hf_models import packed_batch

    batch = packed_batch([[5, 6, 7], [8, 9], [10, 11, 12, 13]], with_labels=True)  # 9 tokens: padded to 12 on 2 ranks
    shards = [shard_batch_for_context_parallel(batch, world_size=2, rank=r) for r in range(2)]
    # chunks of 3: rank 0 holds tokens 0-2 and 9-11 (pad), rank 1 tokens 3-8
    assert shards[0]["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0]]
    assert shards[1]["input_ids"].tolist() == [[8, 9, 10, 11, 12, 13]]
    assert shards[1]["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]]
    # targets shifted within documents before sharding: a document's last token predicts nothing
    assert shards[0]["shift_labels"].tolist() == [[6, 7, -100, -100, -100, -100]]
    assert shards[1]["shift_labels"].tolist() == [[9, -100, 11, 12, 13, -100]]
    assert shards[0]["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and shards[0]["cu_seq_lens_k"] is shards[0]["cu_seq_lens_q"]
    assert shards[0]["max_length_q"] == 4
    assert shards[0]["num_items_in_batch"] == 6 / 2


def test_the_batch_helper_keeps_only_the_tokens_a_padding_mask_keeps():
    batch = {"input_ids": torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]]), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    local = shard_batch_for_context_parallel(batch, world_size=1, rank=0)
    assert local["input_ids"].tolist() == [[3, 4, 5, 6, 7, 8, 9, 0]]
    assert local["cu_seq_lens_q"].tolist() == [0, 3, 7]
    assert local["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


def _layer_call(q_len=8, kv_len=8, **kwargs):
    class Module:
        is_causal = True

    q = torch.randn(1, 4, q_len, 16)
    k = torch.randn(1, 2, kv_len, 16)
    return cudnn_attention_forward(Module(), q, k, k.clone(), kwargs.pop("attention_mask", None), **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention_mask=torch.ones(1, 8, dtype=torch.bool)), "padding attention_mask"),
        (dict(kv_len=12), "KV cache"),
        (dict(softcap=30.0), "logit softcapping"),
        (dict(position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])), "not this rank's share of one sequence"),
    ],
)
def test_the_layer_refuses_what_it_cannot_serve_on_sharded_sequences(kwargs, message):
    world = context_parallel.SimulatedWorld(1)
    with context_parallel.over(collectives=world.rank(0)), pytest.raises(ValueError, match=message):
        _layer_call(**kwargs)
