"""Tiny transformers models with context parallelism on N gloo ranks against one process (CP 1): loss and every gradient.

Every rank builds the same model (``support.hf_models.build``: seeded, float32, ``attn_implementation="cudnn"``) and
the same batch. The reference is the model's own forward and backward on the whole batch in one process. The
context-parallel step shards the batch (``shard_batch_for_context_parallel``), runs the model inside
``context_parallel.over()``, and averages loss and gradients over the group (``average_gradients``). Each rank reports
``[error, magnitude]`` of the loss and of the largest parameter-gradient error.
"""

from __future__ import annotations

import torch

from cudnn_attention import context_parallel
from cudnn_attention.integrations.hf import shard_batch_for_context_parallel
from support.hf_models import build, documents, packed_batch

# name -> (model, batch kind); documents of the packed rows cross the chunk borders of 2 and 4 ranks.
HF_CASES = {
    "mistral-packed": ("mistral", "packed"),
    "gpt_oss-packed": ("gpt_oss", "packed"),
    "mistral-rows": ("mistral", "rows"),
    "gpt_oss-padded_rows": ("gpt_oss", "padded"),
    # Rows sharded by hand along the sequence (no cu_seq_lens): the layer's dense context-parallel path.
    "gpt_oss-dense_shards": ("gpt_oss", "rows"),
}
LENGTHS = (7, 13, 3, 9, 6)  # 38 tokens: padded to 40 on 2 ranks, 48 on 4 (the pad tokens are in no document)


def _batch(kind: str) -> dict:
    docs = documents(LENGTHS, seed=1)
    if kind == "packed":
        return packed_batch(docs, with_labels=True)
    ids = torch.tensor([docs[1][:12], docs[3][:9] + docs[2][:3]])  # two rows of 12
    if kind == "rows":
        return {"input_ids": ids, "labels": ids.clone()}
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a right-padded row: its padding is dropped, not attended
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run_hf_case(model_name: str, kind: str, rank: int, world_size: int) -> dict:
    batch = _batch(kind)
    model = build(model_name, attn_implementation="cudnn").train()
    loss = model(**batch).loss
    loss.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    reference_loss = loss.item()
    model.zero_grad()

    if kind == "rows" and model_name == "gpt_oss":
        local = _dense_shards(batch, rank, world_size)
    else:
        local = shard_batch_for_context_parallel(batch, group=None)
    with context_parallel.over():
        loss = model(**local).loss
    loss.backward()
    context_parallel.average_gradients(model.parameters())
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    errors = {name: (p.grad - reference[name]).abs().max().item() for name, p in model.named_parameters()}
    worst = max(errors, key=errors.get)
    return {
        "loss": [abs(total.item() / world_size - reference_loss), abs(reference_loss)],
        "grads": [errors[worst], reference[worst].abs().max().item()],
        "worst": worst,
        "sinks_trained": any("sinks" in name for name in errors),
    }


def _dense_shards(batch: dict, rank: int, world_size: int) -> dict:
    """Each row its own sequence, sharded along dim 1 with its positions; labels shifted before sharding; the loss scaled
    as shard_batch_for_context_parallel scales it."""
    ids = batch["input_ids"]
    shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    positions = torch.arange(ids.shape[1]).expand_as(ids)

    def mine(t):
        return context_parallel.shard(t, world_size=world_size, rank=rank, dim=1)

    return dict(
        input_ids=mine(ids),
        position_ids=mine(positions),
        labels=mine(shift),
        shift_labels=mine(shift),
        num_items_in_batch=int((shift != -100).sum()) / world_size,
    )


def run_lightning_mesh_case(rank: int, world_size: int) -> dict:
    """ModelParallelStrategy's mesh shape and names: the helper's group is the tensor_parallel row."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cudnn_attention.integrations.lightning import context_parallel_group

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("data_parallel", "tensor_parallel"))

    class Module:  # a LightningModule exposes the strategy's mesh as device_mesh
        device_mesh = mesh

    group = context_parallel_group(Module())
    return {"ranks": dist.get_process_group_ranks(group), "size": dist.get_world_size(group)}


def run_hf_suite(rank: int, world_size: int) -> dict:
    results = {name: run_hf_case(model, kind, rank, world_size) for name, (model, kind) in HF_CASES.items()}
    results["lightning_mesh"] = run_lightning_mesh_case(rank, world_size)
    return results


# Data parallelism beside context parallelism: a (dp, cp) mesh of 2 x N/2 ranks, each dp row its own packed batch, the
# gradient averaged by DDP or FSDP2 over every rank (the README's recipe: the context-parallel ranks are part of the
# data-parallel group). The reference is one process's step on the mean of the dp rows' losses.
MESH_LENGTHS = ((7, 13, 3, 9, 6), (11, 4, 15, 8))


def _wrapped(wrapper: str, model):
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, find_unused_parameters=True)  # experts a row's tokens never reach
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)  # one dimension over every rank: dp x cp flattened


def run_hf_mesh_case(model_name: str, wrapper: str, rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "cp"))
    batches = [packed_batch(documents(lengths, seed=seed), with_labels=True) for seed, lengths in enumerate(MESH_LENGTHS)]
    model = build(model_name, attn_implementation="cudnn").train()
    (sum(model(**batch).loss for batch in batches) / len(batches)).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}

    model = build(model_name, attn_implementation="cudnn").train()  # the same seeded weights, no gradient yet
    wrapped = _wrapped(wrapper, model)
    cp_group = mesh.get_group("cp")
    local = shard_batch_for_context_parallel(batches[mesh.get_local_rank("dp")], group=cp_group)
    with context_parallel.over(cp_group):
        wrapped(**local).loss.backward()
    errors = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2 keeps each rank's shard
        errors[name] = (grad - reference[name]).abs().max().item()
    worst = max(errors, key=errors.get)
    dist.barrier()
    return {"grads": [errors[worst], reference[worst].abs().max().item()], "worst": worst, "compared": len(errors)}


def run_hf_mesh_suite(rank: int, world_size: int) -> dict:
    return {
        f"{model_name}-{wrapper}": run_hf_mesh_case(model_name, wrapper, rank, world_size)
        for model_name in ("mistral", "gpt_oss")
        for wrapper in ("ddp", "fsdp2")
    }
