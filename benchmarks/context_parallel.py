"""Context parallelism on N GPUs (issue 43's run): exactness against one GPU, then scaling, memory and communication share.

    python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/context_parallel.py exactness --out benchmarks/results
    python3 -m torch.distributed.run --nproc_per_node 8 benchmarks/context_parallel.py scaling --family gpt_oss --tokens 32768 131072
    python3 -m torch.distributed.run --nproc_per_node 8 benchmarks/context_parallel.py scaling --family llama --baseline torch

``exactness``: every mask kind with sinks, packed documents crossing rank borders and dense sequences; each rank compares
its shard of the context-parallel result (out, LSE, dq, dk, dv, dsinks summed over ranks) with the same call on the
whole sequence on its own GPU, and the table gives the largest error relative to the result's magnitude.
``scaling``: the recipes' model presets (``--size``, ``--family``), one packed document of each ``--tokens`` length split
over the N ranks, ``--steps`` forward+backward steps: tokens/s per GPU, peak memory per GPU, and the share of the step
the K/V collectives take (the all-gather and its reduce-scatter, or a window's point-to-point exchange), each timed
between two device synchronizations: an upper bound, since those stop the overlap the collectives would otherwise get.
``--baseline torch`` runs torch's ``context_parallel`` (ring over SDPA, causal only; Llama-like models) at the same
lengths instead.

On a CPU (gloo) every mode runs too, on the exact fallback: that checks the plumbing, not the speed (the session that
wrote this had no GPU; the figures come from issue 43's run). Results go to ``<out>/context_parallel_<mode>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import cudnn_attention
from cudnn_attention import context_parallel
from cudnn_attention.cp_collectives import ProcessGroupCollectives
from cudnn_attention.cp_sharding import shard

MASKS = {
    "full": {},
    "causal": dict(causal=True),
    "causal window 128": dict(causal=True, window_size=(127, 0)),
    "bidirectional window (64, 32)": dict(window_size=(64, 32)),
}


def _setup():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return device, torch.bfloat16 if cuda else torch.float32


def exactness(args) -> list[dict]:
    device, dtype = _setup()
    N, rank = dist.get_world_size(), dist.get_rank()
    T, H, H_kv, D = args.chunk * 2 * N, 16, 4, 128
    lengths = [args.chunk + 37, 0, T // 2 - 50, 1]  # across rank borders, an empty document, a tail in no document
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    rows = []
    for api in ("varlen", "dense"):
        for name, options in MASKS.items():
            torch.manual_seed(0)
            shape = (lambda h: (T, h, D)) if api == "varlen" else (lambda h: (1, h, T, D))
            whole = [torch.randn(*shape(h), device=device, dtype=dtype, requires_grad=True) for h in (H, H_kv, H_kv)]
            sinks = torch.randn(H, device=device, requires_grad=True)
            dim = 0 if api == "varlen" else 2
            local = [shard(t, world_size=N, rank=rank, dim=dim).detach().requires_grad_() for t in whole]
            local_sinks = sinks.detach().clone().requires_grad_()

            def run(q, k, v, s):
                if api == "varlen":
                    return cudnn_attention.varlen_attention(q, k, v, cu, cu, T, T, sinks=s, return_lse=True, **options)
                return cudnn_attention.attention(q, k, v, sinks=s, return_lse=True, **options)

            out, lse = run(*whole, sinks)
            grad_out = torch.randn_like(out)
            ref_grads = torch.autograd.grad((out * grad_out).sum(), [*whole, sinks])
            with context_parallel.over():
                out_l, lse_l = run(*local, local_sinks)
            grads = list(torch.autograd.grad((out_l * shard(grad_out, world_size=N, rank=rank, dim=dim)).sum(), [*local, local_sinks]))
            dist.all_reduce(grads[3])
            pairs = [("out", out_l, out), ("lse", lse_l, lse)]
            pairs += [(f"d{n}", g, shard(r, world_size=N, rank=rank, dim=dim)) for n, g, r in zip("qkv", grads, ref_grads)]
            pairs.append(("dsinks", grads[3], ref_grads[3]))
            row = {"api": api, "mask": name}
            for quantity, got, ref in pairs:
                ref = shard(ref, world_size=N, rank=rank, dim=dim) if quantity in ("out", "lse") else ref
                finite = torch.isfinite(ref)
                error = (torch.where(finite, got.float() - ref.float(), 0)).abs().max()
                magnitude = torch.where(finite, ref.float(), 0).abs().max()
                worst = torch.stack([error / magnitude.clamp_min(1e-30)])
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                row[quantity] = worst.item()
            rows.append(row)
    return rows


class _TimedCollectives(ProcessGroupCollectives):
    """The collectives, each call timed between two device synchronizations."""

    seconds = 0.0

    def _timed(self, function, x):
        if x.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = function(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        _TimedCollectives.seconds += time.perf_counter() - started
        return out

    def all_gather_rows(self, x):
        return self._timed(super().all_gather_rows, x)

    def reduce_scatter_rows(self, x):
        return self._timed(super().reduce_scatter_rows, x)

    def exchange_rows(self, x, requests, *, backward=False):
        return self._timed(lambda t: super(_TimedCollectives, self).exchange_rows(t, requests, backward=backward), x)


def scaling(args) -> list[dict]:
    from cudnn_attention.integrations.hf import shard_batch_for_context_parallel
    from cudnn_attention.recipes.common.config import model_shape
    from cudnn_attention.recipes.common.model import build_model

    device, dtype = _setup()
    if args.baseline == "torch" and device.type != "cuda":
        raise SystemExit("--baseline torch needs GPUs: torch's context_parallel has no sharding rule for the CPU's SDPA kernel")
    N = dist.get_world_size()
    implementation = "sdpa" if args.baseline == "torch" else "cudnn"
    shape = model_shape(family=args.family, size=args.size)
    model = build_model(
        attn_implementation=implementation,
        family=args.family,
        shape=shape,
        vocab_size=32000,
        max_positions=max(args.tokens),
        device=device,
        dtype=dtype,
    )
    rows = []
    for tokens in args.tokens:
        torch.manual_seed(0)
        ids = torch.randint(3, 32000, (1, tokens))
        batch = {"input_ids": ids, "labels": ids.clone()}
        seconds, comm = [], []
        for step in range(args.steps + 1):  # the first step builds graphs: left out
            _TimedCollectives.seconds = 0.0
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            loss = _step(model, batch, args, device, shard_batch_for_context_parallel)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step:
                seconds.append(time.perf_counter() - started)
                comm.append(_TimedCollectives.seconds)
            model.zero_grad(set_to_none=True)
        step_s = sum(seconds) / len(seconds)
        rows.append(
            {
                "implementation": "torch context_parallel (sdpa)"
                if args.baseline == "torch"
                else "cudnn_attention (all-gather, window exchange)",
                "family": args.family,
                "size": args.size,
                "gpus": N,
                "tokens": tokens,
                "tokens_per_s_per_gpu": tokens / step_s / N,
                "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                "communication_share": sum(comm) / sum(seconds),
            }
        )
    return rows


def _step(model, batch, args, device, shard_batch):
    if args.baseline == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
        ids = batch["input_ids"].to(device)
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        positions = torch.arange(ids.shape[1], device=device)[None]
        with torch_context_parallel(mesh, buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1]):
            return model(input_ids=ids, position_ids=positions, labels=labels, shift_labels=labels).loss
    local = shard_batch(batch, device=device)
    with context_parallel.over(collectives=_TimedCollectives(None)):
        return model(**local).loss


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("exactness", "scaling"))
    parser.add_argument("--chunk", type=int, default=512, help="exactness: tokens per zigzag chunk (T = 2 N chunk)")
    parser.add_argument("--family", default="gpt_oss", choices=("gpt_oss", "mistral", "llama"))
    parser.add_argument("--size", default="small", help="scaling: the recipes' size preset of the model body")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536, 131072], help="scaling: tokens per sequence")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--baseline", choices=("torch",), help="scaling: torch's context_parallel (sdpa) instead")
    parser.add_argument("--out", type=Path, default=None, help="folder for context_parallel_<mode>.md/.json (rank 0)")
    args = parser.parse_args(argv)
    rows = exactness(args) if args.mode == "exactness" else scaling(args)
    if dist.get_rank() == 0:
        columns = list(rows[0])
        table = "\n".join(
            ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns) + " |" for row in rows]
        )
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (gloo, exact fallback)"
        text = f"context parallelism, {args.mode}, {dist.get_world_size()} ranks, {device}, torch {torch.__version__}\n\n{table}\n"
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"context_parallel_{args.mode}.md").write_text(text)
            (args.out / f"context_parallel_{args.mode}.json").write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
