"""GPU fuzz: thousands of seeded random configurations against the float64 reference, several worker processes on one GPU.

Dense, right-padded and packed calls over BHSD / BSHD-view / head-major THD / interleaved-qkv layouts, GQA and
MQA, D 32..256 (D_v sometimes different), no mask / causal / left-right windows / bottom-right, sinks, default,
random, zero and negative scales, float16 and bfloat16; out, lse, dq, dk, dv and dsinks must each sit within
FlashAttention's rule (error <= 2 x the same math's error in the input dtype + 1e-3 x |reference|), and rows
that see no key (or keys no row sees) must be exactly zero. Cases served by the fallback count too.

Each worker (``tests/support/fuzz_worker.py``, driven by ``tests/support/fuzz_runner.py``) logs every case before and after
running it, so a GPU fault is a failing case naming its config (the parent restarts a worker after the case that killed it),
not a dead suite.

Knobs: ``CUDNN_ATTENTION_FUZZ_CASES`` (4000), ``CUDNN_ATTENTION_FUZZ_WORKERS`` (12), ``CUDNN_ATTENTION_FUZZ_SEED``
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


@pytest.mark.gpu
def test_gpu_fuzz(tmp_path):
    total = _env_int("CUDNN_ATTENTION_FUZZ_CASES", 4000)
    workers = _env_int("CUDNN_ATTENTION_FUZZ_WORKERS", 12)
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
