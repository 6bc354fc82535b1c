"""One packed fine-tuning step (forward, backward, AdamW) of a transformers model on cudnn_attention against
flex_attention, sdpa and eager: tokens/s, step ms, peak memory, and where the step's GPU time goes.

    python benchmarks/end_to_end.py --out benchmarks/results          # llama, gpt-oss and long (sized for < 8 min on an H200)
    python benchmarks/end_to_end.py --configs long --impls cudnn flex_attention --steps 20 --no-profile
    python benchmarks/end_to_end.py --quick                           # CPU plumbing: tiny models, 2 steps, seconds

Method: each configuration's model is built once from a transformers config (random init, bf16 weights and bf16
AdamW states, no autocast, no download). Every implementation starts from the same weights (restored from a CPU
copy) with a fresh AdamW, is switched in with ``model.set_attn_implementation``, and trains on the same batches:
documents flattened into one row by transformers' ``DataCollatorWithFlattening``, already on the device, fed either
as ``position_ids`` alone or with the flash kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``) as well. ``--warmup``
steps run first and are not timed (they hold flex_attention's compile), then (``--warm-shapes``, the default) one
untimed forward over copies of each timed batch, so that what a long run pays once per shape (cuDNN's graphs for each
document-count and length bucket, any flex_attention recompile) is not inside the timing, while what is derived per batch
tensor (the documents read from ``position_ids``, the prefix-sum checks) still is: copies are new tensors. Then ``--steps``
steps are timed together with CUDA events, then one more step runs under torch.profiler for the time shares and the top kernels.
On gpt-oss, eager and flex_attention get document masks built from position_ids (the recipes' ``packing_safe_masks``
hook, inside the timed step). A row that
runs out of memory (eager at these lengths) says so, and its memory is freed before the next row. Writes
``end_to_end.md`` and ``end_to_end.json`` to ``--out`` (a ``--quick`` run writes only when given ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.metadata
import json
import platform
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType

import cudnn_attention
from cudnn_attention.environment import versions
from cudnn_attention.recipes.common.compare import skip_reason
from cudnn_attention.recipes.common.config import ModelShape, model_shape
from cudnn_attention.recipes.common.model import MASKED_IMPLEMENTATIONS
from cudnn_attention.recipes.common.model import build_model as build_recipe_model
from cudnn_attention.recipes.common.reporting import fallback_reasons

# flash_attention_4: FlashAttention 4 through transformers where flash-attn-4 is installed on an sm90/sm100 GPU;
# elsewhere its row says why it was not measured.
IMPLEMENTATIONS = ("cudnn", "flash_attention_4", "flex_attention", "sdpa", "eager")
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# flex_attention accepts the flash kwargs without error, so it gets both rows; sdpa and eager would only repeat
# their position_ids row. flex ignores them (transformers 5.17-5.24 build its block mask from position_ids).
BOTH_PACKINGS = ("cudnn", "flash_attention_4", "flex_attention")
# Kernel names, lower-cased, tested in this order. Attention: cuDNN's fused kernels (cudnn_generated_*sdpa*),
# torch's flash/efficient kernels (flash_*, fmha_cutlass*) and flex's Triton templates (triton_tem_*: flex is the only
# thing compiled here, so every template is one of its kernels). Eager attention is plain gemm/softmax and is not
# counted. Copies: every kernel named for a copy (direct_copy_kernel: .contiguous(), transposes, dtype casts;
# CatArrayBatchedCopy: torch.cat; Memcpy DtoD/HtoD).
ATTENTION_WORDS = ("attention", "attn", "fmha", "flash", "sdpa", "cudnn", "flex", "triton_tem")
COPY_WORDS = ("copy", "memcpy")
RULE = (
    f"attention: kernel names containing any of {', '.join(ATTENTION_WORDS)} (eager's gemm/softmax not counted); "
    f"copies: names containing {' or '.join(COPY_WORDS)}; idle: the timed mean step time minus the union of the kernel "
    "intervals of one more, profiled step. Shares are of the timed mean step time."
)


@dataclass(frozen=True)
class Setup:
    """A model configuration and its packing: ``tokens`` real tokens per step in one row, documents of
    ``doc_range`` tokens, plus one of ``lead_document`` tokens in every step when set."""

    name: str
    family: str  # "llama" or "gpt_oss"
    shape: ModelShape
    tokens: int
    doc_range: tuple[int, int]
    lead_document: int = 0
    vocab: int = 32000


def preset_shape(*, family: str, size: str, **changes) -> ModelShape:
    """The recipes' ``size`` preset of ``family`` with ``changes``, every token routed to every expert (:func:`build_model`
    says why)."""
    shape = model_shape(family=family, size=size)
    return dataclasses.replace(shape, experts_per_token=shape.experts, **changes)


# The recipes' presets, so that the benchmark measures the models the recipes train.
SETUPS = {
    "llama": Setup("llama", "llama", preset_shape(family="llama", size="small"), 16384, (256, 4096)),
    "gpt-oss": Setup("gpt-oss", "gpt_oss", preset_shape(family="gpt_oss", size="small"), 16384, (256, 4096)),
    "long": Setup("long", "llama", preset_shape(family="llama", size="long"), 49152, (2048, 8192), lead_document=16384),
}


def quick(setup: Setup) -> Setup:
    """The tiny version of ``setup`` for the CPU plumbing run."""
    shape = preset_shape(family=setup.family, size="tiny", window=16 if setup.shape.window else None)
    return dataclasses.replace(
        setup, shape=shape, tokens=256, doc_range=(16, 96), lead_document=128 if setup.lead_document else 0, vocab=256
    )


def build_model(setup: Setup, device: str):
    """A random-initialized causal LM in bf16 on ``device`` (seed 0), built as the recipes build theirs: gpt-oss
    with even-numbered layers sliding, learnable sinks in every layer and its masks kept per document (the
    recipes' ``packing_safe_masks``). Every token goes to every expert, so routing near-ties (which bf16
    rounding flips differently per implementation) change nothing."""
    return build_recipe_model(
        attn_implementation="eager",
        family=setup.family,
        shape=setup.shape,
        vocab_size=setup.vocab,
        max_positions=max(setup.tokens, 4096),
        device=device,
        dtype=torch.bfloat16,
        seed=0,
    )


def document_lengths(setup: Setup, generator: torch.Generator) -> list[int]:
    """Lengths summing to ``setup.tokens``, each within ``setup.doc_range``, in random order."""
    shortest, longest = setup.doc_range
    lengths = [setup.lead_document] if setup.lead_document else []
    left = setup.tokens - sum(lengths)
    while left > 0:
        n = min(int(torch.randint(shortest, longest + 1, (1,), generator=generator)), left)
        if left - n < shortest:  # leave no remainder shorter than a document may be
            n = left if left <= longest else left - shortest
        lengths.append(n)
        left -= n
    return [lengths[i] for i in torch.randperm(len(lengths), generator=generator).tolist()]


def make_batches(setup: Setup, count: int, device: str) -> list[dict]:
    """``count`` packed steps of random tokens, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes them."""
    from transformers import DataCollatorWithFlattening

    collate, generator = DataCollatorWithFlattening(return_flash_attn_kwargs=True), torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        docs = [torch.randint(0, setup.vocab, (n,), generator=generator).tolist() for n in document_lengths(setup, generator)]
        batch = collate([{"input_ids": doc} for doc in docs])
        batches.append({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    return batches


def train_step(model, optimizer, inputs: dict) -> None:
    """Forward, backward and AdamW step on one packed batch."""
    model(**inputs).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed_seconds(step, batches: list[dict], device: str) -> float:
    """Wall time of the steps back to back: CUDA events on a GPU, ``perf_counter`` on a CPU."""
    if device != "cuda":
        start = time.perf_counter()
        for batch in batches:
            step(batch)
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for batch in batches:
        step(batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def summarize(kernels: list[tuple[str, float, float]], step_us: float, *, top: int = 8) -> dict:
    """Shares of a step of ``step_us`` µs held by its kernels ``(name, start_us, end_us)``, by category, and idle:
    the step time not covered by any kernel (overlapping kernels count once)."""
    spent, busy, covered_to = {"attention": 0.0, "copies": 0.0, "other": 0.0}, 0.0, float("-inf")
    by_name: dict[str, list] = {}
    for name, first, last in sorted(kernels, key=lambda kernel: kernel[1]):
        spent[category(name)] += last - first
        busy += max(0.0, last - max(first, covered_to))
        covered_to = max(covered_to, last)
        by_name.setdefault(name, [0.0, 0])
        by_name[name][0] += last - first
        by_name[name][1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])
    return {
        "busy_ms": busy / 1000,
        **{f"{what}_pct": 100 * us / step_us for what, us in spent.items()},
        "idle_pct": 100 * max(0.0, step_us - busy) / step_us,
        "top_kernels": [
            {"name": name[:120], "ms": us / 1000, "calls": calls, "pct": 100 * us / step_us, "category": category(name)}
            for name, (us, calls) in ranked[:top]
        ],
        # Every kernel, for comparing two implementations' steps kernel by kernel (the JSON only: the table shows the top).
        "kernels": [{"name": name, "ms": us / 1000, "calls": calls, "category": category(name)} for name, (us, calls) in ranked],
    }


def category(kernel: str) -> str:
    name = kernel.lower()
    if any(word in name for word in ATTENTION_WORDS):
        return "attention"
    return "copies" if any(word in name for word in COPY_WORDS) else "other"


def profiled_kernels(step, batch: dict, device: str) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every kernel, memcpy and memset of one step under torch.profiler.
    On a CPU the leaf aten operators stand in for kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profiler:
        step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
    if device == "cuda":  # record_function regions (torch.compile's among them) also appear on the GPU timeline: not kernels
        found = [e for e in profiler.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    else:
        found = [e for e in profiler.events() if e.device_type == DeviceType.CPU and e.name.startswith("aten::") and not e.cpu_children]
    return [(e.name, e.time_range.start, e.time_range.end) for e in found]


def described(error: Exception) -> str:
    """An error in one table cell: its type and the start of its first line."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:100]}"


def graph_builds(*, since: tuple[int, float] = (0, 0.0)) -> tuple[int, float]:
    """(graphs built, seconds spent building them) by cudnn_attention since its stats were reset, or since an earlier answer."""
    builds = cudnn_attention.stats()["graph_builds"]
    return builds["forward"] + builds["backward"] - since[0], builds["seconds"] - since[1]


def warm_shapes(model, batches: list[dict]) -> None:
    """One forward of each batch, on copies of its tensors, gradients enabled (so cuDNN resolves the backward graph too)."""
    for batch in batches:
        model(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})


def run_one(
    model,
    initial: dict,
    setup: Setup,
    impl: str,
    packing: str,
    batches: list[dict],
    *,
    warmup: int,
    profile: bool,
    device: str,
    shapes_first: bool = True,
) -> dict:
    """One (implementation, packing) row: warm-up, the shape pass (``shapes_first``, see :func:`warm_shapes`), timed steps,
    peak memory, and the profile of one more step."""
    row, notes = {"config": setup.name, "implementation": impl, "packing": packing}, []
    try:
        model.set_attn_implementation(impl)
    except (ValueError, ImportError) as error:  # gpt-oss refuses sdpa; flex needs a torch that has it
        return row | {"error": f"not supported: {described(error)}", "note": ""}
    if reason := skip_reason(impl, device=device):
        return row | {"error": reason, "note": ""}
    if packing == "position_ids":
        batches = [{k: v for k, v in batch.items() if k not in FLASH_KWARGS} for batch in batches]
    elif impl == "flex_attention":
        notes.append("flex ignores cu_seq_lens_*/max_length_* (documents from position_ids)")
    if setup.family == "gpt_oss" and impl in MASKED_IMPLEMENTATIONS:
        notes.append("masks from position_ids (packing_safe_masks)")
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    step = functools.partial(train_step, model, optimizer)
    cudnn_attention.reset_stats()
    try:
        # The warm-up holds every first-call cost (flex_attention's compile, FA4's JIT, cuDNN graph builds): reported, as
        # a fine-tuning run pays it once per shape it meets.
        start = time.perf_counter()
        for batch in batches[:warmup]:
            step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        row["warmup_s"] = time.perf_counter() - start
        timed = batches[warmup:-1]
        if shapes_first:
            before = graph_builds()
            warm_shapes(model, timed)
            built, build_seconds = graph_builds(since=before)
            if built:
                notes.append(f"{built} cuDNN graphs built for the timed batches' shapes before the timing ({build_seconds:.2f} s)")
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = graph_builds()
        seconds = timed_seconds(step, timed, device)
        built, build_seconds = graph_builds(since=before)
        if built:  # a batch with document counts or lengths not seen before: its graphs' build time is in the step time
            notes.append(f"{built} cuDNN graphs built during the timed steps ({build_seconds:.2f} s)")
        row |= {
            "tokens_per_s": setup.tokens * len(timed) / seconds,
            "step_ms": 1000 * seconds / len(timed),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        }
        # Profiled after the timing: since torch 2.7 (pytorch#146604) CUPTI is torn down when a profile ends, so the
        # next rows' timings do not pay for it. Shares are of the timed step: the profiler's host cost is no idle time.
        if profile:
            row["profile"] = summarize(profiled_kernels(step, batches[-1], device), 1000 * row["step_ms"])
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as error:  # noqa: BLE001 - one row's failure (a compile error, say) is reported, the others still run
        traceback.print_exc()
        row["error"] = described(error)
    if impl == "cudnn":
        row["cudnn_stats"] = cudnn_attention.stats()
        if reasons := fallback_reasons(row["cudnn_stats"]):
            notes.append(f"exact fallback: {', '.join(reasons)}")
        elif row["cudnn_stats"].get("cudnn_forward"):
            notes.append("cuDNN served every call")
    row["note"] = "; ".join(notes)
    del optimizer, step
    model.zero_grad(set_to_none=True)
    gc.collect()  # the activations of a step that ran out of memory are held by its traceback's frames
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def add_ratios(rows: list[dict]) -> None:
    """tokens/s and peak memory against FlashAttention 4, flex_attention and sdpa of the same run, same packing where
    measured."""
    refs_by_key = {
        key: {r["packing"]: r for r in rows if r["implementation"] == name and r.get("tokens_per_s")}
        for name, key in (("flash_attention_4", "fa4"), ("flex_attention", "flex"), ("sdpa", "sdpa"))
    }
    for row in rows:
        for key, refs in refs_by_key.items():
            ref = refs.get(row["packing"]) or refs.get("position_ids")
            if ref and row.get("tokens_per_s"):
                row[f"vs_{key}_tokens"] = row["tokens_per_s"] / ref["tokens_per_s"]
                if ref.get("peak_gib") and row.get("peak_gib"):
                    row[f"vs_{key}_peak"] = row["peak_gib"] / ref["peak_gib"]


def markdown(rows: list[dict], header: list[str]) -> str:
    def number(value, spec):
        return "" if value is None else format(value, spec)

    columns = [
        "config",
        "implementation",
        "packing",
        "tokens/s",
        "step ms",
        "peak GiB",
        "warm-up s",
        "× FA4 tok/s",
        "× FA4 peak",
        "× flex tok/s",
        "× flex peak",
        "× sdpa tok/s",
        "attention %",
        "copies %",
        "idle %",
        "note",
    ]
    lines = [*header, "", f"| {' | '.join(columns)} |", "|---" * len(columns) + "|"]
    for r in rows:
        if "error" in r:
            empty = " |" * (len(columns) - 5)
            lines.append(f"| {r['config']} | {r['implementation']} | {r['packing']} | {r['error']} |{empty} {r['note']} |")
            continue
        p = r.get("profile", {})
        cells = [
            number(r["tokens_per_s"], ",.0f"),
            number(r["step_ms"], ".1f"),
            number(r["peak_gib"], ".2f"),
            number(r.get("warmup_s"), ".1f"),
            number(r.get("vs_fa4_tokens"), ".2f"),
            number(r.get("vs_fa4_peak"), ".2f"),
            number(r.get("vs_flex_tokens"), ".2f"),
            number(r.get("vs_flex_peak"), ".2f"),
            number(r.get("vs_sdpa_tokens"), ".2f"),
            number(p.get("attention_pct"), ".0f"),
            number(p.get("copies_pct"), ".0f"),
            number(p.get("idle_pct"), ".0f"),
        ]
        lines.append(f"| {r['config']} | {r['implementation']} | {r['packing']} | {' | '.join(cells)} | {r['note']} |")
    lines += ["", f"Profile rule: {RULE}"]
    for r in rows:
        if r.get("profile"):
            lines += [
                "",
                (
                    f"Top kernels, {r['config']} / {r['implementation']} / {r['packing']} "
                    f"(kernels busy {r['profile']['busy_ms']:.1f} ms of a {r['step_ms']:.1f} ms step):"
                ),
                "",
                "| ms | calls | % of step | category | kernel |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {k['ms']:.2f} | {k['calls']} | {k['pct']:.1f} | {k['category']} | `{k['name']}` |" for k in r["profile"]["top_kernels"]
            ]
    return "\n".join(lines)


def describe(setup: Setup) -> str:
    shape = setup.shape
    lead = f", one of {setup.lead_document:,} in every step" if setup.lead_document else ""
    extra = f", window {shape.window} on even layers, sinks, {shape.experts} experts (all used)" if setup.family == "gpt_oss" else ""
    return (
        f"{setup.name}: {setup.family}, {shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.heads}/{shape.kv_heads} heads x {shape.head_dim}, "
        f"MLP {shape.intermediate}{extra}, vocab {setup.vocab}; {setup.tokens:,} tokens per step in one row, documents of "
        f"{setup.doc_range[0]}-{setup.doc_range[1]}{lead}."
    )


def environment(args, device: str) -> list[str]:
    found = versions()
    try:
        fa4 = f", flash-attn-4 {importlib.metadata.version('flash-attn-4')}"
    except importlib.metadata.PackageNotFoundError:
        fa4 = ""
    where = found["gpu"] if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    lines = [
        (
            f"{where}; torch {found['torch']}, transformers {found['transformers']}, cuDNN {found['torch_cudnn']} in torch and "
            f"{found['cudnn_backend']} under cuDNN frontend {found['cudnn_frontend'] or 'not installed'}{fa4}."
        ),
        (
            f"bf16 weights and AdamW states (no autocast); {args.warmup} untimed warm-up step(s) (flex_attention's compile among them), "
            + (
                "then one untimed forward over copies of each timed batch (graphs and recompiles for their shapes), "
                if args.warm_shapes
                else ""
            )
            + f"{args.steps} timed steps, same weights and batches for every row; tokens/s counts real tokens (no padding)."
        ),
    ]
    if device != "cuda":
        lines.append(
            "CPU run: 'cudnn' runs on cudnn_attention's exact PyTorch fallback, not on cuDNN, and leaf aten operators stand in "
            "for kernels in the profile: the numbers check plumbing only."
        )
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark with command-line ``argv`` (default ``sys.argv``); print the table, write the files, return the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), help="attn_implementation names")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10; --quick: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first, with any compile (default 3; --quick: 1)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True, help="profile one more step per row")
    parser.add_argument(
        "--warm-shapes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one untimed forward over copies of the timed batches first: one-time per-shape work (graph builds) out of the timing",
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 steps, 256 tokens: the plumbing, on a CPU in seconds")
    parser.add_argument("--out", type=Path, default=None, help="folder for end_to_end.md/.json (default benchmarks/results; --quick: none)")
    args = parser.parse_args(argv)
    args.steps = (2 if args.quick else 10) if args.steps is None else args.steps
    args.warmup = (1 if args.quick else 3) if args.warmup is None else args.warmup
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be at least 1 and --warmup at least 0, got --steps {args.steps} --warmup {args.warmup}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.quick:
        parser.error("this benchmark needs a CUDA GPU; --quick runs its plumbing on a CPU")
    out = args.out or (None if args.quick else Path(__file__).resolve().parent / "results")
    rows, setups = [], {name: quick(SETUPS[name]) if args.quick else SETUPS[name] for name in args.configs}
    for setup in setups.values():
        model = build_model(setup, device)
        initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        batches = make_batches(setup, args.warmup + args.steps + 1, device)
        config_rows = []
        for impl in args.impls:
            for packing in ("position_ids", "flash kwargs") if impl in BOTH_PACKINGS else ("position_ids",):
                config_rows.append(
                    run_one(
                        model,
                        initial,
                        setup,
                        impl,
                        packing,
                        batches,
                        warmup=args.warmup,
                        profile=args.profile,
                        device=device,
                        shapes_first=args.warm_shapes,
                    )
                )
                print(json.dumps({k: v for k, v in config_rows[-1].items() if k not in ("profile", "cudnn_stats")}), flush=True)
        add_ratios(config_rows)
        rows += config_rows
        del model, initial, batches
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        # The next configuration compiles flex_attention afresh in its own warm-up, rather than recompiling
        # against the recompile limit what earlier shapes left behind.
        torch.compiler.reset()
    header = environment(args, device)
    table = markdown(rows, [*header, "", *(f"- {describe(setup)}" for setup in setups.values())])
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "end_to_end.md").write_text(table + "\n")
        payload = {
            "environment": header,
            "rule": RULE,
            "setups": {n: dataclasses.asdict(s) for n, s in setups.items()},
            "quick": args.quick,
            "rows": rows,
        }
        (out / "end_to_end.json").write_text(json.dumps(payload, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
