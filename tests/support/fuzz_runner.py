"""The fuzz driver: seeded cases run by ``fuzz_worker.py`` processes, each logging every case before and after it runs,
so a worker killed by a GPU fault leaves the case that killed it (recorded as a crash; a new worker starts after it).
The GPU fuzz (``tests/gpu/test_gpu_fuzz.py``) and its CPU check (``tests/unit/test_fuzz_cpu.py``) both run it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from support.fuzz_cases import FAMILY

__all__ = ["run_fuzz"]

WORKER = Path(__file__).with_name("fuzz_worker.py")
ROOT = WORKER.parents[2]  # the repository: workers run from there, as the repro lines do
MAX_RESTARTS_PER_LANE = 25


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
        command = [sys.executable, str(WORKER), "--seed", str(seed), "--start", str(self.next), "--count", str(self.stop - self.next)]
        command += ["--out", str(self.log), "--device", device, "--profile", profile, "--threads", str(threads)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.err, cwd=ROOT)


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
            records[index] = {
                "index": index,
                "ok": False,
                "path": "crash",
                "label": "?",
                "exception": f"worker died ({why}, exit status {returncode}) while running this case; stderr tail: {stderr[-1500:]}",
            }
        done = set(started) | ended
        lane.next = max(done) + 1 if done else lane.next
        if returncode not in (0, None) and not dangling and not done and lane.next < lane.stop:
            # Died before its first case (import error, no GPU): charge the next case so the lane moves on.
            records[lane.next] = {
                "index": lane.next,
                "ok": False,
                "path": "crash",
                "label": "?",
                "exception": f"worker died before its first case (exit status {returncode}); stderr tail: {stderr[-1500:]}",
            }
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
