"""The Trainer recipes' ``--context_parallel N``: each pack is split across N ranks (context parallelism), on the recipe's own loop.

Where it runs:

* a CPU without a launcher: this process starts N gloo processes (the tiny preset, exact fallback math) and reports
  what they measured, as a one-process run does;
* under ``torchrun``/``accelerate launch`` (``WORLD_SIZE`` set): every process is one rank. The world is a (D, N) mesh:
  each of the D data-parallel groups of N ranks trains on its own packs, each rank on its shard of them; on GPUs with
  NCCL, e.g. ``torchrun --nproc_per_node 8 recipes/train_sinks.py --context_parallel 4`` (D = 2).

The loop is the Trainer recipes' optimizer written out (AdamW, the scheduler of ``--lr_scheduler_type`` after
``--warmup_steps``, gradients clipped to ``--max_grad_norm``) because transformers' Trainer cannot split a pack across
ranks (its own context parallelism goes through accelerate to torch's ring SDPA, which refuses sliding windows and sinks).
Each step: the group's pack is sharded (``shard_batch_for_context_parallel``), the model runs inside
``cudnn_attention.context_parallel.over``, and gradients are averaged over all D x N ranks (the loss is scaled so that this
is the whole pack's gradient). Metrics are those of every recipe: tokens/s and MFU over the D groups, losses averaged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import tempfile
from pathlib import Path

import torch

from .config import check_machine, check_strict
from .data import STATS_KEY, PackedCollator, dataset_of
from .errors import RecipeError, flag
from .flops import step_flops_of
from .model import model_of
from .reporting import announce_run, fallback_announced, finish
from .run_dirs import checked_output_dir, new_run_dir, remove_empty_dirs
from .steps import StepRecorder
from .tokenizer import load_tokenizer

__all__ = ["check_context_parallel", "run_context_parallel"]

_TIMEOUT = datetime.timedelta(minutes=10)


def check_context_parallel(run_options, args) -> None:
    """Raise :class:`RecipeError` for what ``--context_parallel`` cannot run with (before anything starts)."""
    N = run_options.context_parallel
    if N < 1:
        raise RecipeError(f"{flag('context_parallel', N)}: pass 1 or more ranks per pack")
    refused = [
        (bool(run_options.compare), "compare", "compare implementations without it"),
        (args.gradient_accumulation_steps != 1, "gradient_accumulation_steps", "pass a larger --tokens_per_step instead"),
        (args.per_device_train_batch_size != 1, "per_device_train_batch_size", "one pack per step is what is split"),
        (
            bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)),
            "gradient_checkpointing",
            "",
        ),
    ]
    for bad, name, hint in refused:
        if bad:
            raise RecipeError(
                f"{flag('context_parallel', N)} runs the recipe's own loop, which does not take {flag(name)}{': ' + hint if hint else ''}"
            )
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world and world % N:
        raise RecipeError(f"{flag('context_parallel', N)} needs a world size divisible by {N}, got {world} processes")
    if not world and not args.use_cpu and torch.cuda.is_available():
        raise RecipeError(
            f"{flag('context_parallel', N)} on GPUs needs one process per GPU: torchrun --nproc_per_node {N} <recipe> "
            f"--context_parallel {N} (or accelerate launch --num_processes {N}); on a CPU, N gloo processes are started here"
        )


def run_context_parallel(options, run_options, args, *, recipe: str) -> dict:
    """Train with ``--context_parallel N`` and return the metrics (written to ``metrics.json`` by rank 0)."""
    check_context_parallel(run_options, args)
    hyper = {
        name: getattr(args, name)
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "lr_scheduler_type", "warmup_steps", "max_steps", "seed")
    }
    hyper["lr_scheduler_type"] = str(getattr(hyper["lr_scheduler_type"], "value", hyper["lr_scheduler_type"]))
    check_machine(size=options.size, tokens_per_step=options.tokens_per_step, device="cpu" if args.use_cpu else "cuda")
    if "WORLD_SIZE" in os.environ:  # launched: this process is one rank
        return _train_rank(
            int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, options, run_options, hyper, args.output_dir, recipe
        )
    import torch.multiprocessing as mp

    N = run_options.context_parallel
    with tempfile.TemporaryDirectory() as work:
        mp.spawn(_spawned_rank, args=(N, work, options, run_options, hyper, args.output_dir, recipe), nprocs=N, join=True)
        return json.loads(Path(work, "metrics.json").read_text())


def _spawned_rank(rank, world_size, work, options, run_options, hyper, output_dir, recipe):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # N processes share this machine's cores
    metrics = _train_rank(rank, world_size, f"file://{Path(work, 'store')}", options, run_options, hyper, output_dir, recipe)
    if rank == 0:
        Path(work, "metrics.json").write_text(json.dumps(metrics))


def _train_rank(rank: int, world_size: int, init_method, options, run_options, hyper: dict, output_dir, recipe: str) -> dict:
    import torch.distributed as dist
    from transformers import get_scheduler

    import cudnn_attention
    from cudnn_attention import context_parallel
    from cudnn_attention.integrations.hf import shard_batch_for_context_parallel

    N = run_options.context_parallel
    cuda = torch.cuda.is_available() and init_method is None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=_TIMEOUT)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        D = world_size // N
        mesh = init_device_mesh(device.type, (D, N), mesh_dim_names=("dp", "cp"))
        cp_group, dp_rank = mesh.get_group("cp"), mesh.get_local_rank("dp")
        check_strict(strict=options.strict, device=device)
        tokenizer = load_tokenizer(tokenizer=options.tokenizer, checkpoint=options.checkpoint)
        dataset = dataset_of(options, tokenizer=tokenizer, seed=hyper["seed"])
        main = rank == 0
        steps = hyper["max_steps"]
        if main:
            announce_run(
                recipe=recipe,
                options=options,
                implementation=options.attn_implementation,
                device=device,
                steps=steps,
                packs=dataset.packs,
                packs_per_step=1,
                world_size=D,
            )
            print(f"context parallelism: {N} ranks per pack ({world_size} processes, {D} data-parallel group(s))")
        output, keep = _output_dir(output_dir, run_options, recipe=recipe, main=main)
        dtype = torch.bfloat16 if cuda else torch.float32
        model = model_of(
            options, implementation=options.attn_implementation, tokenizer=tokenizer, device=device, dtype=dtype, seed=hyper["seed"]
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=hyper["learning_rate"], weight_decay=hyper["weight_decay"])
        scheduler = get_scheduler(hyper["lr_scheduler_type"], optimizer, num_warmup_steps=hyper["warmup_steps"], num_training_steps=steps)
        recorder = StepRecorder(step_flops=step_flops_of(model), device=device, planned_steps=steps, world_size=D)
        collate = PackedCollator()
        with fallback_announced(device=str(device)), cudnn_attention.strict() if options.strict else contextlib.nullcontext():
            for step in range(steps):
                recorder.begin()
                batch = collate([dataset[(step * D + dp_rank) % len(dataset)]])  # the same pack on every rank of a group
                counts = batch.pop(STATS_KEY)
                local = shard_batch_for_context_parallel(batch, group=cp_group, pad_token_id=tokenizer.pad_token_id or 0, device=device)
                with context_parallel.over(cp_group):
                    loss = model(**local).loss
                loss.backward()
                context_parallel.average_gradients(model.parameters())  # every rank: dp x cp
                torch.nn.utils.clip_grad_norm_(model.parameters(), hyper["max_grad_norm"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                reported = loss.detach().clone()
                dist.all_reduce(reported)  # the group's mean is the pack's loss; the world's, the mean over packs
                recorder.add_batch(counts, reported / world_size)
                recorder.end_step()
                if main and (step + 1) % max(1, steps // 10) == 0:
                    print(f"step {step + 1}/{steps}: loss {recorder.losses[-1].item():.4f}")
        result = recorder.result(
            attn_implementation=options.attn_implementation,
            gather=lambda t: _gather_groups(t, world_size, N),
            distributed=f"context parallel x {N}" + (f", {D} data-parallel groups" if D > 1 else ""),
        )
        config = {**dataclasses.asdict(options), **dataclasses.asdict(run_options), **hyper, "steps": steps, "output_dir": str(output)}
        try:
            return finish(
                recipe=recipe,
                results={options.attn_implementation: result},
                primary=options.attn_implementation,
                config=config,
                output_dir=output,
                title=f"{recipe}: {options.model_name()}, context parallel x {N}",
                write=main,
            )
        finally:
            if main:
                remove_empty_dirs(output, keep=keep)
    finally:
        dist.destroy_process_group()


def _gather_groups(t: torch.Tensor, world_size: int, N: int) -> torch.Tensor:
    """``t`` of the first rank of each context-parallel group, stacked (their N ranks share a pack: counted once)."""
    import torch.distributed as dist

    every = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(every, t.contiguous())
    return torch.stack(every[::N])


def _output_dir(output_dir, run_options, *, recipe: str, main: bool) -> tuple[Path, Path]:
    import torch.distributed as dist

    if output_dir is not None:
        return checked_output_dir(output_dir, overwrite=run_options.overwrite_output_dir)
    chosen = [str(new_run_dir(recipe)) if main else None]
    dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0]), Path.cwd()
