"""transformers under context parallelism: this rank's shard of a batch, for a model running ``attn_implementation="cudnn"``
inside ``cudnn_attention.context_parallel.over(group)``.

Example (one training step on every rank of the context-parallel group):
    >>> from cudnn_attention import context_parallel
    >>> from cudnn_attention.integrations.hf import shard_batch_for_context_parallel
    >>> local = shard_batch_for_context_parallel(batch, group=cp_group)   # same full batch on every rank of cp_group
    >>> with context_parallel.over(cp_group):
    ...     loss = model(**local).loss     # this rank's share; averaged over cp_group it is the whole batch's loss
    ...     loss.backward()
    >>> context_parallel.average_gradients(model.parameters(), group=cp_group)   # or DDP/FSDP over the dp x cp ranks

What the batch becomes: every sequence (a row, a row's kept tokens under an ``attention_mask``, or the documents of a
packed row, found from ``cu_seq_lens_*`` or ``position_ids`` as transformers finds them) is a document of ONE packed
row, padded to a multiple of 2N tokens (the pad tokens belong to no document: zero attention, no label), cut into
2N chunks of which this rank keeps chunks r and 2N-1-r (:mod:`cudnn_attention.cp_sharding`):

* ``input_ids`` and ``position_ids`` (1, T/N): positions are each document's own, so rotary embeddings see the true
  positions of the sharded tokens;
* ``labels`` and ``shift_labels`` (1, T/N): the labels shifted BEFORE sharding (the target of token t is token t+1 of
  its document), so no token's target lives on another rank; transformers' causal-LM loss uses ``shift_labels`` as given;
* ``cu_seq_lens_q``/``cu_seq_lens_k`` (one tensor, the WHOLE row's documents) and ``max_length_q``/``max_length_k``:
  the attention layer serves the whole row's masks from them; their host values ride on the tensor, so no layer
  reads the device (:func:`cudnn_attention.context_parallel.remember_prefix_sums`);
* ``num_items_in_batch``: the whole row's label count divided by N. transformers divides the summed token losses by
  it, so each rank's loss is N x (its tokens' loss sum) / (all labels): averaging the losses, or the gradients, over
  the group (as DDP/FSDP average over data-parallel ranks) gives exactly the whole batch's mean loss and gradient.

transformers' own context-parallel path (``supports_context_parallel``, accelerate's ``cp_size``) is not used: it drops
the attention mask for torch's ring SDPA, so it refuses sliding-window models (gpt-oss, Mistral) and packed documents.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from ...context_parallel import remember_prefix_sums
from ...cp_sharding import shard_positions

__all__ = ["shard_batch_for_context_parallel"]


def shard_batch_for_context_parallel(
    batch: Mapping,
    *,
    group=None,
    world_size: int | None = None,
    rank: int | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    device=None,
) -> dict:
    """This rank's shard of ``batch`` (module docstring): keys ``input_ids``, ``position_ids``, ``cu_seq_lens_q``/``_k``,
    ``max_length_q``/``_k``, and with labels ``labels``, ``shift_labels`` and ``num_items_in_batch``.

    Args:
        batch: ``input_ids`` (B, S) and optionally ``labels``, ``position_ids``, ``attention_mask`` (B, S) and the flash
            kwargs ``cu_seq_lens_q``/``cu_seq_lens_k`` (B = 1) of ``DataCollatorWithFlattening``; the SAME batch on
            every rank of the group. Other keys are left out.
        group: the context-parallel process group (default: the whole world); ``world_size``/``rank`` instead give
            the split without torch.distributed (a simulated split, tests).
        pad_token_id, ignore_index: what pads the row to a multiple of 2N, and the label that is not predicted.
        device: where the shard goes (default: ``input_ids``'s); the documents are worked out on the host either way, and
            the prefix sums made there keep their host values (no layer reads them back).
    """
    if world_size is None or rank is None:
        import torch.distributed as dist

        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, sequence), got shape {tuple(input_ids.shape)}")
    device = input_ids.device if device is None else torch.device(device)
    tokens_BS, documents = _documents(batch)
    columns = {"input_ids": input_ids, "position_ids": batch.get("position_ids")}
    row = {name: _flatten(values, tokens_BS) for name, values in columns.items() if values is not None}
    lengths = [stop - start for start, stop in documents]
    if "position_ids" not in row:
        row["position_ids"] = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    labels = batch.get("labels")
    if labels is not None:
        row["shift_labels"] = _shift_within_documents(_flatten(labels, tokens_BS), documents, ignore_index)
    T = sum(lengths)
    padded = max(1, -(-T // (2 * world_size))) * 2 * world_size
    fill = {"input_ids": pad_token_id, "position_ids": 0, "shift_labels": ignore_index}
    positions = shard_positions(padded, world_size, rank)
    local = {
        name: torch.cat([values.cpu(), values.new_full((padded - T,), fill[name]).cpu()])[positions].view(1, -1).to(device)
        for name, values in row.items()
    }
    cu = [0, *itertools.accumulate(lengths)]
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    remember_prefix_sums(cu_seqlens, cu)
    longest = max(lengths, default=0)
    local.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest)
    if labels is not None:
        local["labels"] = local["shift_labels"]
        local["num_items_in_batch"] = int((row["shift_labels"] != ignore_index).sum()) / world_size
    return local


def _documents(batch: Mapping) -> tuple[torch.Tensor | None, list[tuple[int, int]]]:
    """``(kept tokens mask (B, S) or None, documents as [start, stop) of the flattened row)``, read on the host."""
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    cu = batch.get("cu_seq_lens_q")
    mask = batch.get("attention_mask")
    if cu is not None:
        if B != 1:
            raise ValueError(f"cu_seq_lens_q describes one packed row; got input_ids of shape {tuple(input_ids.shape)}")
        bounds = cu.tolist()
        if bounds[-1] != S:
            raise ValueError(
                f"cu_seq_lens_q ends at {bounds[-1]}, not at the row's {S} tokens: every token of a packed row is in a document"
            )
        return None, [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    if mask is not None:
        keep_BS = mask.bool().cpu()
        counts = keep_BS.sum(dim=1).tolist()
        starts = [0, *itertools.accumulate(counts)]
        return keep_BS, [(a, b) for a, b in zip(starts, starts[1:]) if b > a]
    position_ids = batch.get("position_ids")
    if B == 1 and position_ids is not None:
        # transformers' rule (find_packed_sequence_indices): a document starts wherever a position does not follow the one before.
        position_T = position_ids.reshape(-1).cpu()
        starts = [0, *((position_T[1:] != position_T[:-1] + 1).nonzero().view(-1) + 1).tolist(), S]
        return None, list(zip(starts, starts[1:]))
    return None, [(b * S, (b + 1) * S) for b in range(B) if S]


def _flatten(values: torch.Tensor, keep_BS: torch.Tensor | None) -> torch.Tensor:
    values = values.cpu()
    return values[keep_BS] if keep_BS is not None else values.reshape(-1)


def _shift_within_documents(labels_T: torch.Tensor, documents, ignore_index: int) -> torch.Tensor:
    """The target of each token: the next token's label within its document, ``ignore_index`` at a document's last token."""
    shifted = torch.full_like(labels_T, ignore_index)
    for start, stop in documents:
        shifted[start : stop - 1] = labels_T[start + 1 : stop]
    return shifted
