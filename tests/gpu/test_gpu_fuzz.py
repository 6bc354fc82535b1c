"""GPU fuzz: thousands of seeded random configurations against the float64 reference, several worker processes on one GPU.

Dense, right-padded and packed calls over BHSD / BSHD-view / head-major THD / interleaved-qkv layouts, GQA and
MQA, D 32..256 (D_v sometimes different), no mask / causal / left-right windows / bottom-right, sinks, default,
random, zero and negative scales, float16 and bfloat16; out, lse, dq, dk, dv and dsinks must each sit within
FlashAttention's rule (error <= 2 x the same math's error in the input dtype + 1e-3 x |reference|), and rows
that see no key (or keys no row sees) must be exactly zero. Cases served by the fallback count too.

Each worker (``tests/fuzz_worker.py``) logs every case before and after running it, so a GPU fault is a failing
case naming its config (the parent restarts a worker after the case that killed it), not a dead suite.

Knobs: ``CUDNN_ATTENTION_FUZZ_CASES`` (4000), ``CUDNN_ATTENTION_FUZZ_WORKERS`` (12), ``CUDNN_ATTENTION_FUZZ_SEED``
(20250611), ``CUDNN_ATTENTION_FUZZ_TIMEOUT`` (seconds, 540), ``CUDNN_ATTENTION_FUZZ_REPORT`` (write the table there).

    python -m pytest -q -s tests/test_gpu_fuzz.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fuzz_cases import FAMILY, summarize

WORKER = Path(__file__).with_name("fuzz_worker.py")
DEFAULT_SEED = 20250611
MAX_RESTARTS_PER_LANE = 25
REPRO = "python tests/fuzz_worker.py --seed {seed} --start {index} --count 1 --out -"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def _split(total: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous ranges of case indices, cut at family boundaries so each family's graphs are built once."""
    families = -(-total // FAMILY)
    per = -(-families // max(workers, 1))
    ranges = []
    for w in range(workers):
        start, stop = w * per * FAMILY, min(total, (w + 1) * per * FAMILY)
        if start < stop:
            ranges.append((start, stop))
    return ranges


def _read_lines(path: Path) -> list[dict]:
    records = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a dying process
    return records


class _Lane:
    def __init__(self, number, start, stop):
        self.number, self.next, self.stop, self.launches, self.proc = number, start, stop, 0, None

    def launch(self, workdir: Path, *, seed, device, profile, threads):
        self.launches += 1
        self.log = workdir / f"lane{self.number}_{self.launches}.jsonl"
        self.err_path = workdir / f"lane{self.number}_{self.launches}.stderr"
        self.err = open(self.err_path, "w")
        command = [sys.executable, str(WORKER), "--seed", str(seed), "--start", str(self.next), "--count", str(self.stop - self.next),
                   "--out", str(self.log), "--device", device, "--profile", profile, "--threads", str(threads)]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.err, cwd=WORKER.parent.parent)


def run_fuzz(total: int, workers: int, seed: int, workdir: Path, *, device="cuda", profile="gpu", timeout=540.0, threads=2):
    """Run ``total`` cases in ``workers`` processes; returns ``(records by index, configs by index)``."""
    records, configs = {}, {}
    lanes = [_Lane(n, a, b) for n, (a, b) in enumerate(_split(total, workers))]
    for lane in lanes:
        lane.launch(workdir, seed=seed, device=device, profile=profile, threads=threads)
    deadline = time.monotonic() + timeout

    def harvest(lane, returncode, why):
        started, ended = {}, set()
        for line in _read_lines(lane.log):
            if line["event"] == "start":
                started[line["index"]] = line
                configs[line["index"]] = line["config"]
            elif line["event"] == "end":
                ended.add(line["index"])
                records[line["index"]] = line
        lane.err.close()
        stderr = lane.err_path.read_text(errors="replace")[-3000:]
        dangling = sorted(set(started) - ended)
        for index in dangling:  # the case the process died in
            records[index] = {"index": index, "ok": False, "path": "crash", "label": "?",
                              "exception": f"worker died ({why}, exit status {returncode}) while running this case; stderr tail: {stderr[-1500:]}"}  # fmt: skip
        done = set(started) | ended
        lane.next = max(done) + 1 if done else lane.next
        if returncode not in (0, None) and not dangling and not done and lane.next < lane.stop:
            # Died before its first case (import error, no GPU): charge the next case so the lane moves on.
            records[lane.next] = {"index": lane.next, "ok": False, "path": "crash", "label": "?",
                                  "exception": f"worker died before its first case (exit status {returncode}); stderr tail: {stderr[-1500:]}"}  # fmt: skip
            lane.next += 1

    while any(lane.proc is not None for lane in lanes):
        time.sleep(0.2)
        timed_out = time.monotonic() > deadline
        for lane in lanes:
            if lane.proc is None:
                continue
            returncode = lane.proc.poll()
            if returncode is None and not timed_out:
                continue
            if returncode is None:
                lane.proc.kill()  # our own worker, by its handle
                lane.proc.wait()
                harvest(lane, "killed", f"timeout after {timeout:.0f} s")
                lane.proc = None
                continue
            harvest(lane, returncode, "exit")
            lane.proc = None
            if lane.next < lane.stop and lane.launches <= MAX_RESTARTS_PER_LANE and not timed_out:
                lane.launch(workdir, seed=seed, device=device, profile=profile, threads=threads)
    return records, configs


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
