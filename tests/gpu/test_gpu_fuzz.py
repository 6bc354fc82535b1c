"""GPU fuzz: thousands of seeded random configurations against the float64 reference, several worker processes on one GPU.

Dense, right-padded and packed calls over BHSD / BSHD-view / head-major THD / interleaved-qkv layouts, GQA and
MQA, D 32..256 (D_v sometimes different), no mask / causal / left-right windows / bottom-right, sinks, default,
random, zero and negative scales, float16 and bfloat16; out, lse, dq, dk, dv and dsinks must each sit within
FlashAttention's rule (error <= 2 x the same math's error in the input dtype + 1e-3 x |reference|), and rows
that see no key (or keys no row sees) must be exactly zero. Cases served by the fallback count too.

Each worker (``tests/support/fuzz_worker.py``, driven by ``tests/support/fuzz_runner.py``) logs every case before and after
running it, so a GPU fault is a failing case naming its config (the parent restarts a worker after the case that killed it),
not a dead suite.

Knobs: ``CUDNN_ATTENTION_FUZZ_CASES`` (4000), ``CUDNN_ATTENTION_FUZZ_WORKERS`` (one per 11 GiB of the GPU's memory, at most
12: 12 on an H200, 7 on an 80 GB H100, see :func:`default_workers`), ``CUDNN_ATTENTION_FUZZ_SEED``
(20250611), ``CUDNN_ATTENTION_FUZZ_TIMEOUT`` (seconds, 540), ``CUDNN_ATTENTION_FUZZ_REPORT`` (write the table there),
``CUDNN_ATTENTION_FUZZ_PASSES_AFTER`` (set: every packed call sets its unwritten rows after the kernels whatever its
size, on outputs allocated as NaN; see ``fuzz_worker``).

    python -m pytest -q -s tests/gpu/test_gpu_fuzz.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from support.fuzz_cases import summarize
from support.fuzz_runner import run_fuzz

DEFAULT_SEED = 20250611
REPRO = "python tests/support/fuzz_worker.py --seed {seed} --start {index} --count 1 --out -"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def default_workers(total_memory_bytes: int) -> int:
    """Worker processes for a GPU of this much memory. Twelve on an 80 GB H100 ran short: 92 of 4,000 cases (cuDNN 9.28.1)
    failed with out-of-memory errors and kernel launches refused (CUDA error 1, then 999) in the workers beside them,
    and every one of them passed when run again alone; on a 141 GB H200 the same 4,000 passed with twelve."""
    return max(1, min(12, total_memory_bytes // (11 * 2**30)))


@pytest.mark.gpu
def test_gpu_fuzz(tmp_path):
    total = _env_int("CUDNN_ATTENTION_FUZZ_CASES", 4000)
    workers = _env_int("CUDNN_ATTENTION_FUZZ_WORKERS", default_workers(torch.cuda.get_device_properties(0).total_memory))
    seed = _env_int("CUDNN_ATTENTION_FUZZ_SEED", DEFAULT_SEED)
    timeout = float(_env_int("CUDNN_ATTENTION_FUZZ_TIMEOUT", 540))
    threads = max(1, min(2, (os.cpu_count() or 2) // max(workers, 1)))
    start = time.monotonic()
    records, configs = run_fuzz(total, workers, seed, tmp_path, device="cuda", timeout=timeout, threads=threads)
    report = summarize(records, configs, seed=seed, requested=total, repro=REPRO)
    report += f"\n\nwall time {time.monotonic() - start:.1f} s, {workers} workers on {torch.cuda.get_device_name(0)}"
    print("\n" + report)
    if os.environ.get("CUDNN_ATTENTION_FUZZ_REPORT"):
        Path(os.environ["CUDNN_ATTENTION_FUZZ_REPORT"]).write_text(report + "\n", encoding="utf-8")
    failed = sorted(i for i, r in records.items() if not r.get("ok"))
    assert len(records) == total, f"only {len(records)} of {total} cases ran (timeout or crashed workers)\n{report}"
    assert not failed, f"{len(failed)} of {total} fuzz cases failed: {failed[:20]}\n{report}"
