"""Forward/backward time and TFLOP/s of cudnn_attention against FlashAttention 4 (where ``flash_attn.cute`` imports),
flex_attention, torch flash, torch's C++ cuDNN path and the cuDNN frontend's own torch ops, at the shapes of the
project's GPU baseline, each dense shape in both layouts (transformers' (B, S, H, D) buffers seen as (B, H, S, D), and
contiguous (B, H, S, D)); plus host microseconds per call at a tiny shape.

    python benchmarks/attention_kernels.py --out benchmarks/results

Prints a Markdown table and writes ``attention_kernels.json`` and ``attention_kernels.md``; the header names the cuDNN
that torch and the frontend loaded. Times are medians of CUDA-event timings of 10 back-to-back calls after warm-up; every
implementation runs in the same process. FlashAttention 4 compiles each new shape on its first call: that time is
reported apart (``first_call_s``), with the kernels it compiled, and ``--recompiles`` counts them over steps
whose documents vary in length, as a packed fine-tuning run's do.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cudnn_attention
from cudnn_attention import environment
from cudnn_attention.cudnn_graphs import built_plans, clear_cache


@dataclass
class Case:
    name: str
    heads_q: int
    heads_kv: int
    head_dim: int
    doc_lengths: list[int]  # one entry per batch row (dense) or document (packed)
    packed: bool
    left: int = -1  # FlashAttention window, causal always
    sinks: bool = False
    layout: str = "bshd"  # dense only: "bshd", (B, S, H, D) buffers seen as (B, H, S, D) (transformers'); "bhsd", contiguous
    results: dict = field(default_factory=dict)

    def visible_pairs(self) -> int:
        w = self.left
        return sum(sum(min(i, w) + 1 if w >= 0 else i + 1 for i in range(n)) for n in self.doc_lengths)

    def flops(self) -> tuple[float, float]:
        forward = 4.0 * self.heads_q * self.head_dim * self.visible_pairs()
        return forward, 2.5 * forward


PACKED_DOCS = [4096, 2900, 2048, 1800, 1500, 1024, 772, 128]  # 8 documents, T = 14268
DENSE_SHAPES = [  # (name, H_q, H_kv, D, lengths, window left)
    ("dense S=1024 B=2", 32, 8, 128, [1024] * 2, -1),
    ("dense S=4096 B=2", 32, 8, 128, [4096] * 2, -1),
    ("dense S=8192 B=1", 32, 8, 128, [8192], -1),
    ("dense S=8192 B=2", 32, 8, 128, [8192] * 2, -1),
    ("dense S=8192 B=1 H=64/8 (NVIDIA's H200 table)", 64, 8, 128, [8192], -1),
    ("dense S=2048 B=4 H=16/4 D=64", 16, 4, 64, [2048] * 4, -1),
    ("dense S=2048 B=4 H=16/16 D=64", 16, 16, 64, [2048] * 4, -1),
    ("dense S=4096 B=2 window 512", 32, 8, 128, [4096] * 2, 512),
]
CASES = [
    Case(f"{name} {layout}", hq, hkv, d, lengths, False, left=left, layout=layout)
    for name, hq, hkv, d, lengths, left in DENSE_SHAPES
    for layout in ("bshd", "bhsd")
] + [
    Case("packed T=14268", 32, 8, 128, PACKED_DOCS, True),
    Case("packed T=14268 window 512", 32, 8, 128, PACKED_DOCS, True, left=512),
    Case("packed gpt-oss H=64/8 D=64 window 128", 64, 8, 64, PACKED_DOCS, True, left=128),
    Case("packed gpt-oss H=64/8 D=64 window 128 sinks", 64, 8, 64, PACKED_DOCS, True, left=128, sinks=True),
    Case("packed gpt-oss H=64/8 D=64 sinks", 64, 8, 64, PACKED_DOCS, True, sinks=True),  # its full-attention layers
    Case("packed gpt-oss 8 x 2048 window 128 sinks", 64, 8, 64, [2048] * 8, True, left=128, sinks=True),  # notes/fa4-on-device.md
    Case("packed gpt-oss 8 x 2048 sinks", 64, 8, 64, [2048] * 8, True, sinks=True),
]


def cuda_time_ms(fn, *, warmup=3, samples=15, calls_per_sample=10) -> float:
    """Median over samples of the mean time of back-to-back calls: what a training loop sees.

    A call whose host work outlasts its kernels is host-bound, and this measures its host time.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_sample):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_sample)
    return statistics.median(times)


def make_inputs(case: Case, seed=0):
    torch.manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    if case.packed:
        T = sum(case.doc_lengths)
        q = torch.randn(T, case.heads_q, case.head_dim, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(T, case.heads_kv, case.head_dim, device=dev, dtype=dt, requires_grad=True)
    elif case.layout == "bshd":  # transformers' layout: (B, S, H, D) buffers seen as (B, H, S, D)
        B, S = len(case.doc_lengths), case.doc_lengths[0]
        q = torch.randn(B, S, case.heads_q, case.head_dim, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
        k = torch.randn(B, S, case.heads_kv, case.head_dim, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    else:
        B, S = len(case.doc_lengths), case.doc_lengths[0]
        q = torch.randn(B, case.heads_q, S, case.head_dim, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(B, case.heads_kv, S, case.head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn_like(k).requires_grad_()
    sinks = torch.randn(case.heads_q, device=dev, dtype=torch.float32, requires_grad=True) if case.sinks else None
    cu = torch.tensor([0, *itertools.accumulate(case.doc_lengths)], device=dev, dtype=torch.int32)
    return q, k, v, sinks, cu


def covering_every_token(cu, tokens: int, max_len: int):
    """A copy of the prefix sums ``cu`` (q's and kv's alike) as the transformers layer hands them to the core:
    checked to end exactly at ``tokens``, so O, the LSE and dQ/dK/dV are allocated without their zero fill."""
    covered = cu.clone()
    cudnn_attention.packed_batch(covered, covered, max_len, max_len, tokens_q=tokens, tokens_kv=tokens, cover_all=True)
    return covered


@functools.cache
def flash_attention_4():
    """``flash_attn.cute`` (FlashAttention 4) where it imports, else ``None`` (the reason printed once)."""
    start = time.perf_counter()
    try:
        import flash_attn.cute as fa4
    except Exception as exc:  # noqa: BLE001 - absent or broken: the table goes on without it
        print(f"FlashAttention 4 unavailable: {type(exc).__name__}: {str(exc)[:200]}")
        return None
    print(f"FlashAttention 4 {_distribution('flash-attn-4')} imported in {time.perf_counter() - start:.1f} s")
    return fa4


def _distribution(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def fa4_compiled_kernels() -> int:
    """How many kernels FlashAttention 4 has compiled in this process (its JIT caches, forward and backward)."""
    from flash_attn.cute import interface

    caches = (getattr(fn, "compile_cache", None) for fn in vars(interface).values())
    return sum(len(getattr(cache, "cache", ())) for cache in caches if cache is not None)


def fa4_window(left: int) -> tuple:
    """FlashAttention 4's ``window_size`` for a causal window ``left`` keys back (-1: none)."""
    return (left if left >= 0 else None, None)


def fa4_varlen(fa4, q, k, v, cu, max_len: int, left: int, sinks):
    """FlashAttention 4's packed causal call, ``left`` keys back (-1: no window); its output."""
    return fa4.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        causal=True,
        window_size=fa4_window(left),
        learnable_sink=sinks,
    )[0]


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Every case is a new shape: past Dynamo's recompile limit (8) a shape runs flex's unfused eager implementation,
    # which took a first run's dense S 8192 case 147 ms forward.
    config = torch._dynamo.config
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", 64)
    return torch.compile(flex_attention)


def flex_call(case: Case, q, k, v, sinks):
    """flex_attention (compiled) with the case's mask as a block mask; sinks as FlashAttention 4 defines them, a logit
    in the softmax's denominator: ``out * sigmoid(lse - sink)`` on flex's output and LSE (exact, differentiable)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    left = case.left
    if case.packed:
        lengths = torch.tensor(case.doc_lengths, device=q.device)
        doc = torch.repeat_interleave(torch.arange(len(case.doc_lengths), device=q.device), lengths)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, T, D) views

        def mask_mod(b, h, q_idx, kv_idx):
            keep = (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])
            return keep & (q_idx - kv_idx <= left) if left >= 0 else keep
    else:
        q4, k4, v4 = q, k, v

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= left) if left >= 0 else q_idx >= kv_idx

    block_mask = create_block_mask(mask_mod, q4.shape[0], None, q4.shape[2], k4.shape[2], device=q.device)
    flex = _compiled_flex()

    def run():
        out, aux = flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
        lse = aux.lse
        if sinks is not None:
            out = (out.float() * torch.sigmoid(lse - sinks[:, None]).unsqueeze(-1)).to(q.dtype)
        return out

    return run


def cudnn_attention_call(case: Case, q, k, v, sinks, cu):
    """The case's forward through cudnn_attention (causal, the case's window and sinks), as a callable."""
    window = (case.left, 0)
    if case.packed:
        max_len = max(case.doc_lengths)
        return lambda: cudnn_attention.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=True, window_size=window, sinks=sinks)
    return lambda: cudnn_attention.attention(q, k, v, causal=True, window_size=window, sinks=sinks)


def implementations(case: Case, q, k, v, sinks, cu):
    """name -> forward callable returning the differentiable output, for implementations that serve the case."""
    max_len = max(case.doc_lengths)
    window = (case.left, 0)
    fa4 = flash_attention_4()
    impls = {"cudnn_attention": cudnn_attention_call(case, q, k, v, sinks, cu)}
    if case.packed:
        # The row above, a plain varlen call, may have a capacity tail and pays the zero fills; this one does not.
        covered = covering_every_token(cu, q.shape[0], max_len)
        impls["cudnn_attention, every token in a document"] = lambda: cudnn_attention.varlen_attention(
            q, k, v, covered, covered, max_len, max_len, causal=True, window_size=window, sinks=sinks
        )
        # Two tensors of the same values, as transformers' flash kwargs (cu_seq_lens_q, cu_seq_lens_k) hand them over.
        cu_kv = cu.clone()
        impls["cudnn_attention, two prefix-sum tensors"] = lambda: cudnn_attention.varlen_attention(
            q, k, v, cu, cu_kv, max_len, max_len, causal=True, window_size=window, sinks=sinks
        )
        if fa4 is not None:
            impls["FlashAttention 4"] = lambda: fa4_varlen(fa4, q, k, v, cu, max_len, case.left, sinks)
        if not case.sinks:
            impls["torch flash"] = lambda: torch.ops.aten._flash_attention_forward(
                q,
                k,
                v,
                cu,
                cu,
                max_len,
                max_len,
                0.0,
                True,
                False,
                window_size_left=case.left if case.left >= 0 else None,
                window_size_right=0,
            )[0]
    else:
        q_bshd, k_bshd, v_bshd = (t.transpose(1, 2) for t in (q, k, v))
        if fa4 is not None:  # (B, S, H, D) as FlashAttention takes them: the buffers themselves, or views of (B, H, S, D) ones
            impls["FlashAttention 4"] = lambda: fa4.flash_attn_func(
                q_bshd, k_bshd, v_bshd, causal=True, window_size=fa4_window(case.left), learnable_sink=sinks
            )[0]
        impls["torch flash"] = lambda: torch.ops.aten._flash_attention_forward(
            q_bshd,
            k_bshd,
            v_bshd,
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            True,
            False,
            window_size_left=case.left if case.left >= 0 else None,
            window_size_right=0,
        )[0]
        if case.left < 0 and not case.sinks:
            group = case.heads_q // case.heads_kv

            def cpp_cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    # The C++ cuDNN path takes no GQA: K/V repeat is part of its cost.
                    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)

            impls["torch cuDNN (C++)"] = cpp_cudnn
    impls["flex_attention"] = flex_call(case, q, k, v, sinks)
    try:
        from cudnn.sdpa.fwd import torch_op  # noqa: F401 - registers torch.ops.cudnn.sdpa_fwd

        lb = case.left + 1 if case.left >= 0 else -1
        scale = case.head_dim**-0.5
        if case.packed:
            impls["upstream cudnn::sdpa_fwd"] = lambda: torch.ops.cudnn.sdpa_fwd(
                q,
                k,
                v,
                scale,
                is_causal=True,
                window_left=lb,
                sinks=sinks,
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
                return_lse=True,
            )[0]
        else:
            impls["upstream cudnn::sdpa_fwd"] = lambda: torch.ops.cudnn.sdpa_fwd(
                q, k, v, scale, is_causal=True, window_left=lb, sinks=sinks, return_lse=True
            )[0]
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking the others
        print(f"upstream ops unavailable: {exc}")
    return impls


def plan_names() -> list[str]:
    """Engine plan of every graph in this project's cache, in build order."""
    return [f"{direction}:{name}" for direction, name in built_plans()]


def run_case(case: Case, only_implementations=()):
    q, k, v, sinks, cu = make_inputs(case)
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    fwd_flops, bwd_flops = case.flops()
    for name, forward in implementations(case, q, k, v, sinks, cu).items():
        if only_implementations and name not in only_implementations:
            continue
        entry = {}
        # Emptied per implementation so its row names every graph it runs, also one an earlier case built
        # (the sink case folds onto the sink-less case's graphs).
        clear_cache()
        try:
            # The first forward and backward: graph builds, JIT compiles, autotuning. A fine-tuning run pays this once
            # per shape it meets (see recompiles_over_varying_documents), so it is reported, apart from the steady-state times.
            kernels_before = fa4_compiled_kernels() if name == "FlashAttention 4" else 0
            start = time.perf_counter()
            first = forward()
            grad_out = torch.randn_like(first)
            try:
                # No retain_graph: a backward that refuses a second pass (flex_attention's) still compiles here.
                torch.autograd.grad(first, inputs, grad_out)
            except Exception:  # noqa: BLE001 - timed again below, which records the error
                pass
            torch.cuda.synchronize()
            entry["first_call_s"] = time.perf_counter() - start
            if name == "FlashAttention 4":
                entry["kernels_compiled"] = fa4_compiled_kernels() - kernels_before
            first = None
            out = forward()  # the graph the backward timing below runs again and again
            entry["fwd_ms"] = cuda_time_ms(forward)
            try:
                entry["bwd_ms"] = cuda_time_ms(lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True))
            except Exception as exc:  # noqa: BLE001
                try:
                    # A compiled graph whose backward donates its saved buffers (flex_attention's) runs once per
                    # forward: its backward is timed as forward+backward less the forward.
                    step_ms = cuda_time_ms(lambda: torch.autograd.grad(forward(), inputs, grad_out))
                    entry["bwd_ms"], entry["bwd_timed"] = step_ms - entry["fwd_ms"], "fwd+bwd less fwd"
                except Exception:  # noqa: BLE001 - no backward at all (the frontend's forward-only op): the first error says why
                    entry["bwd_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            entry["fwd_tflops"] = fwd_flops / entry["fwd_ms"] / 1e9
            if "bwd_ms" in entry:
                entry["bwd_tflops"] = bwd_flops / entry["bwd_ms"] / 1e9
                entry["fwd_bwd_ms"] = entry["fwd_ms"] + entry["bwd_ms"]
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        entry["plans"] = sorted(set(plan_names()))
        case.results[name] = entry
        out = grad_out = None  # this implementation's graph is freed before the next one is timed (one that failed bound neither)
    torch.cuda.empty_cache()


def recompiles_over_varying_documents(steps: int = 8, tokens: int = 16384) -> dict:
    """The first-call seconds of each step of a packed gpt-oss-like run (H 64/8, D 64, window 128, sinks) whose
    documents change in number and length every step, as a packed fine-tuning run's do, for cudnn_attention and
    FlashAttention 4, with what each built in that step (cuDNN graphs cached, FA4 kernels compiled): the cost of a
    step that meets a new shape."""
    generator = torch.Generator().manual_seed(0)
    fa4 = flash_attention_4()
    steps_run = {"cudnn_attention": [], "FlashAttention 4": []} if fa4 is not None else {"cudnn_attention": []}
    for step in range(steps):
        documents = int(torch.randint(1, 13, (1,), generator=generator))
        cuts = sorted((torch.randperm(tokens - 1, generator=generator)[: documents - 1] + 1).tolist())
        lengths = [end - begin for begin, end in zip([0, *cuts], [*cuts, tokens])]
        case = Case("varying documents", 64, 8, 64, lengths, True, left=128, sinks=True)
        q, k, v, sinks, cu = make_inputs(case, seed=step)
        max_len = max(lengths)
        calls = {
            "cudnn_attention": lambda: cudnn_attention.varlen_attention(
                q, k, v, cu, cu, max_len, max_len, causal=True, window_size=(128, 0), sinks=sinks
            ),
            "FlashAttention 4": lambda: fa4_varlen(fa4, q, k, v, cu, max_len, 128, sinks),
        }
        for name, record in steps_run.items():
            built = fa4_compiled_kernels if name == "FlashAttention 4" else lambda: len(built_plans())
            before = built()
            start = time.perf_counter()
            out = calls[name]()
            torch.autograd.grad(out, (q, k, v, sinks), torch.ones_like(out))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            record.append({"documents": documents, "max_seqlen": max_len, "first_call_s": seconds, "built": built() - before})
    return steps_run


def profile_case(case: Case, names=("cudnn_attention", "FlashAttention 4")) -> None:
    """Print each of ``names``' device kernels over three forward+backward steps at ``case``'s shape: what runs
    besides the attention kernels (copies, transposes, fills, reductions) and how long each takes."""
    q, k, v, sinks, cu = make_inputs(case)
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    impls = implementations(case, q, k, v, sinks, cu)
    for name in names:
        if name not in impls:
            continue
        out = impls[name]()
        grad_out = torch.randn_like(out)
        torch.autograd.grad(out, inputs, grad_out)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                torch.autograd.grad(impls[name](), inputs, grad_out)
            torch.cuda.synchronize()
        print(f"--- profile: {case.name} / {name}: kernels over 3 forward+backward steps")
        try:
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=90))
        except Exception:  # noqa: BLE001 - torch before the device_time names
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=90))


def host_us_in_turns(fns: dict, iters: int, rounds: int = 10, *, sync=torch.cuda.synchronize) -> dict:
    """Microseconds per call of each of ``fns``, measured in turns: in each of ``rounds`` rounds every function
    runs ``iters / rounds`` calls in a row, and each keeps its least round mean (timeit's rule). Taking turns puts
    every implementation through the same spells of the host's other work, which on the H200 machine moved one
    implementation's plain mean by up to 45% between two runs of the same code (torch's C++ cuDNN op: 23.7 and
    34.4 us) and favoured whichever row ran in a quiet spell. ``sync`` ends each round's queued device work."""
    for fn in fns.values():
        for _ in range(100):
            fn()
    sync()
    block = max(1, iters // rounds)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(block):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / block * 1e6)
    return best


class _AutogradFloor(torch.autograd.Function):
    """What ``torch.autograd.grad`` costs through a Python autograd node that does no work: its backward hands
    back gradients made beforehand. A backward's own host time is its ``autograd.grad`` time less this floor."""

    @staticmethod
    def forward(ctx, q, k, v, grads):
        ctx.grads = grads
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad_out):
        return (*ctx.grads, None)


def host_overhead_us(iters=2000) -> dict:
    """Host microseconds per call at B=H=1, S=128, D=64 (launch-bound: measures Python and dispatch), for a
    no-grad forward, a forward whose inputs require grad (no backward), and a backward alone (``autograd.grad``
    of the output, with the same sum of three gradients into one leaf for every row); "backward less floor" takes
    off what ``autograd.grad`` costs through a Python node that does no work (``_AutogradFloor``, measured in the
    same run): the node's own time for the Python implementations. The packed rows split the 128 tokens into
    two documents of 64."""
    torch.manual_seed(0)
    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    q_grad = q.clone().requires_grad_()
    cu = torch.tensor([0, 64, 128], device="cuda", dtype=torch.int32)
    covered = covering_every_token(cu, 128, 64)
    packed = lambda t: t[0].transpose(0, 1)  # noqa: E731 - (T, H, D) view of the same memory
    floor_grads = tuple(torch.randn_like(q) for _ in range(3))
    calls = {
        "cudnn_attention": lambda t: cudnn_attention.attention(t, t, t),
        "torch flash": lambda t: torch.ops.aten._scaled_dot_product_flash_attention(t, t, t)[0],
        "torch cuDNN (C++)": lambda t: torch.ops.aten._scaled_dot_product_cudnn_attention(t, t, t, None, False)[0],
        "autograd floor (Python node, no work)": lambda t: _AutogradFloor.apply(t, t, t, floor_grads),
        "cudnn_attention packed": lambda t: cudnn_attention.varlen_attention(packed(t), packed(t), packed(t), cu, cu, 64, 64),
        "cudnn_attention packed, every token in a document": lambda t: cudnn_attention.varlen_attention(
            packed(t), packed(t), packed(t), covered, covered, 64, 64
        ),
        "torch flash varlen": lambda t: torch.ops.aten._flash_attention_forward(
            packed(t), packed(t), packed(t), cu, cu, 64, 64, 0.0, False, False
        )[0],
    }
    backwards = {}
    for name, fn in list(calls.items()):
        try:  # one call of each kind first: a private op another torch lacks is reported, the rest still measured
            with torch.no_grad():
                fn(q)
            out = fn(q_grad)
            grad_out = torch.randn_like(out)
            torch.autograd.grad(out, q_grad, grad_out, retain_graph=True)
        except Exception as error:  # noqa: BLE001
            print(f"host time of {name}: {type(error).__name__}: {error}")
            del calls[name]
            continue
        backwards[name] = lambda out=out, grad_out=grad_out: torch.autograd.grad(out, q_grad, grad_out, retain_graph=True)
    with torch.no_grad():
        no_grad = host_us_in_turns({name: lambda fn=fn: fn(q) for name, fn in calls.items()}, iters)
    grad_fwd = host_us_in_turns({name: lambda fn=fn: fn(q_grad) for name, fn in calls.items()}, iters)
    backward = host_us_in_turns(backwards, iters)
    result = {name: {"no-grad forward": no_grad[name], "grad forward": grad_fwd[name], "backward": backward[name]} for name in calls}
    floor = result.get("autograd floor (Python node, no work)", {}).get("backward")
    for name in ("cudnn_attention", "torch flash", "torch cuDNN (C++)"):
        if floor is not None and name in result:
            result[name]["backward less floor"] = result[name]["backward"] - floor
    return result


def sink_forward_comparison(case: Case) -> dict:
    """The sink forward two ways at ``case``'s shape: cuDNN's sink engine, and the sink-less kernel plus the LSE
    fold (``plan.sink_forward``), against the same graph without sinks; with each one's error against fp32
    attention on the same inputs (max abs, output), and the engine plan of each graph it ran (the cache is
    emptied before each way, so they are the graphs that way needs); ``"default"`` is the way this process runs."""
    from cudnn_attention import plan
    from cudnn_attention.masking import make_mask_spec
    from cudnn_attention.reference import varlen_reference

    q, k, v, sinks, cu = make_inputs(case)
    max_len, window = max(case.doc_lengths), (case.left, 0)
    q, k, v, sinks = (t.detach() for t in (q, k, v, sinks))

    def run(s):
        return cudnn_attention.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=True, window_size=window, sinks=s)

    mask = make_mask_spec(causal=True, bottom_right=False, window_size=window)
    reference, _ = varlen_reference(
        q.float(), k.float(), v.float(), cu, cu, max_len, max_len, scale=case.head_dim**-0.5, mask=mask, sinks_H=sinks
    )
    saved = plan.sink_forward
    result = {"default": saved()}
    try:
        with torch.no_grad():
            clear_cache()
            result["no sinks"] = {"fwd_ms": cuda_time_ms(lambda: run(None)), "plans": plan_names()}
            for way in ("engine", "fold"):
                plan.sink_forward = lambda way=way: way
                clear_cache()
                error = (run(sinks).float() - reference).abs().max().item()
                result[way] = {"fwd_ms": cuda_time_ms(lambda: run(sinks)), "max_abs_err": error, "plans": plan_names()}
    finally:
        plan.sink_forward = saved
    for way in ("engine", "fold"):
        result[way]["vs no sinks"] = result[way]["fwd_ms"] / result["no sinks"]["fwd_ms"]
    return result


def versions_line() -> str:
    """The versions every table is read against: which cuDNN torch loaded and which the frontend (this project) loaded."""
    found = environment.versions()
    fa4 = _distribution("flash-attn-4")
    return (
        f"GPU: {found['gpu']}, torch {found['torch']} (CUDA {found['cuda']}), cuDNN {found['torch_cudnn']} in torch and "
        f"{found['cudnn_backend']} under cuDNN frontend {found['cudnn_frontend']}"
        + (f", FlashAttention 4 {fa4}" if fa4 else "")
        + ", bf16, causal."
    )


def write_table(lines: list[str], out: Path | None, name: str) -> None:
    """``lines`` into ``out/name`` (the folder made if missing); nothing when ``out`` is None (no ``--out``)."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def markdown(cases, host, sinks=None, recompiles=None) -> str:
    lines = [
        versions_line(),
        "",
        "Last column: that row's fwd+bwd time over cudnn_attention's (above 1: cudnn_attention is faster).",
        "",
        "| case | implementation | fwd ms | fwd TF/s | bwd ms | bwd TF/s | fwd+bwd ms | its time / cudnn_attention's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        ours = case.results.get("cudnn_attention", {}).get("fwd_bwd_ms")
        for name, r in case.results.items():
            if "error" in r:
                lines.append(f"| {case.name} | {name} | error: {r['error']} | | | | | |")
                continue
            total = r.get("fwd_bwd_ms")
            ratio = f"{total / ours:.2f}x" if ours and total and name != "cudnn_attention" else ""
            bwd = (f"{r['bwd_ms']:.3f}", f"{r['bwd_tflops']:.0f}") if "bwd_ms" in r else (r.get("bwd_error", "-")[:40], "")
            lines.append(
                f"| {case.name} | {name} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {bwd[0]} | {bwd[1]} | {total:.3f} | {ratio} |"
                if total
                else f"| {case.name} | {name} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {bwd[0]} | | | |"
            )
    lines += ["", "First call (s: graph builds, JIT compiles; FA4: kernels compiled):", ""]
    lines += [
        f"- {case.name}: "
        + ", ".join(
            f"{name} {r['first_call_s']:.2f}" + (f" ({r['kernels_compiled']} kernels)" if "kernels_compiled" in r else "")
            for name, r in case.results.items()
            if "first_call_s" in r
        )
        for case in cases
    ]
    lines += ["", "Engine plans chosen:", ""]
    lines += [
        f"- {case.name} / {name}: {', '.join(r.get('plans', [])) or 'n/a'}"
        for case in cases
        for name, r in case.results.items()
        if name.startswith("cudnn_attention")
    ]
    for name, steps in (recompiles or {}).items():
        lines += [
            "",
            f"{name}, a packed run whose documents change every step (T 16384, H 64/8, D 64, window 128, sinks): first-call s "
            "(built) per step:",
            "",
            ", ".join(f"{step['first_call_s']:.2f} ({step['built']})" for step in steps),
        ]
    if host:
        lines += [
            "",
            (
                "Host microseconds per call (the implementations measured in turns, ten rounds of 200 calls, "
                "the least round mean of each), "
                "B=H=1, S=128, D=64 (packed: two documents of 64); "
                "backward is `torch.autograd.grad`, and "
                "less floor is that minus the floor row's (a Python autograd node that does no work):"
            ),
            "",
            "| implementation | no-grad forward | grad forward | backward | backward less floor |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {r['no-grad forward']:.1f} | {r['grad forward']:.1f} | {r['backward']:.1f} | {r['backward less floor']:.1f} |"
            if "backward less floor" in r
            else f"| {name} | {r['no-grad forward']:.1f} | {r['grad forward']:.1f} | {r['backward']:.1f} | |"
            for name, r in host.items()
        ]
    for name, ways in (sinks or {}).items():
        lines += [
            "",
            f"Sink forward at {name} (setting: {ways['default']}):",
            "",
            "| way | fwd ms | vs no sinks | max abs err vs fp32 | engine plans |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {way} | {r['fwd_ms']:.3f} | {r.get('vs no sinks', 1.0):.2f}x | {r.get('max_abs_err', float('nan')):.2e} | "
            f"{', '.join(r['plans'])} |"
            for way, r in ways.items()
            if way != "default"
        ]
    return "\n".join(lines)


SINK_CASES = [case for case in CASES if case.sinks]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", default="", help="run cases whose name contains this text (a|b: a's first)")
    parser.add_argument("--host-only", action="store_true", help="only the host microseconds (printed as JSON, nothing written)")
    parser.add_argument("--implementations", default="", help="names of the rows to run, separated by | (names hold commas; default: all)")
    parser.add_argument("--no-host", action="store_true", help="skip the host microseconds and the sink-forward comparison")
    parser.add_argument("--profile", default="", help="print the device kernels of cases whose name contains this text")
    parser.add_argument(
        "--recompiles", action="store_true", help="first-call time per step of a packed run whose documents vary (FA4's JIT)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_kernels.py measures cuDNN kernels and needs a CUDA GPU; none is visible here.")
    if args.host_only:
        print(json.dumps({"cudnn_attention": cudnn_attention.__file__, "host_us": host_overhead_us()}))
        return
    print(versions_line(), flush=True)
    # "a|b": the cases whose name contains a, then those with b (in that order, each once).
    cases = [case for part in args.only.split("|") for case in CASES if part in case.name]
    cases = [case for i, case in enumerate(cases) if all(case is not seen for seen in cases[:i])]
    wanted = [name for name in args.implementations.split("|") if name]
    for case in cases:
        run_case(case, wanted)
        print(case.name, json.dumps(case.results), flush=True)
    unknown = [name for name in wanted if all(name not in case.results for case in cases)]
    if unknown:
        print(f"--implementations: no case ran a row named {', '.join(map(repr, unknown))}")
    if args.profile:
        for case in cases:
            if args.profile in case.name:
                profile_case(case)
    recompiles = recompiles_over_varying_documents() if args.recompiles else None
    if recompiles:
        print("recompiles", json.dumps(recompiles), flush=True)
    host = host_overhead_us() if not args.no_host else {}
    sinks = {case.name: sink_forward_comparison(case) for case in SINK_CASES if case in cases} if not args.no_host else {}
    table = markdown(cases, host, sinks, recompiles)
    print(table)
    print("stats:", cudnn_attention.stats())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_kernels.md").write_text(table + "\n")
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "versions": environment.versions(),
        "cases": [asdict(c) for c in cases],
        "host_us": host,
        "sinks": sinks,
        "recompiles": recompiles,
    }
    (args.out / "attention_kernels.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
