"""Context-parallel test suites on N gloo processes, started once per suite (not per case) in a fresh interpreter.

``run_suite(name, world_size)`` starts ``world_size`` processes (``python -c "...main()"``, one per rank); each initializes gloo
through a file store (no port to collide with) with a short collective timeout, so that a hang fails the suite instead of
blocking CI, runs every case of the suite (``SUITES[name]``: a function ``(rank, world_size) -> {case: result}``), and
writes its results as JSON. The caller gets ``{case: [result of rank 0, result of rank 1, ...]}``.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# suite name -> "module:function" (imported in the ranks only)
SUITES = {
    "core": "support.cp_cases:run_core_suite",
    "hf": "support.cp_hf_cases:run_hf_suite",
    "hf_mesh": "support.cp_hf_cases:run_hf_mesh_suite",
}
COLLECTIVE_TIMEOUT_S = 60


def run_suite(name: str, world_size: int, *, timeout: float = 300) -> dict[str, list]:
    """Every case's per-rank results of suite ``name`` on ``world_size`` gloo processes."""
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as work:
        code = "from support.cp_launch import main; main()"
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", code, name, str(rank), str(world_size), work],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for rank in range(world_size)
        ]
        outputs = []
        try:
            for process in ranks:
                outputs.append(process.communicate(timeout=timeout))
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()  # only the processes this function started
        failed = [(rank, process.returncode, outputs[rank][1][-4000:]) for rank, process in enumerate(ranks) if process.returncode]
        assert not failed, f"suite {name} on {world_size} ranks failed: " + "\n".join(
            f"rank {r} (exit {c}):\n{err}" for r, c, err in failed
        )
        per_rank = [json.loads(Path(work, f"rank{rank}.json").read_text()) for rank in range(world_size)]
    return {case: [results[case] for results in per_rank] for case in per_rank[0]}


def main() -> None:
    """One rank (``python -c ... name rank world_size work_dir``): gloo through a file store, the suite, its results as JSON."""
    import warnings

    import torch
    import torch.distributed as dist

    name, rank, world_size, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    warnings.simplefilter("ignore")  # the exact path's fallback warning
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(work, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        module, function = SUITES[name].split(":")
        results = getattr(importlib.import_module(module), function)(rank, world_size)
        Path(work, f"rank{rank}.json").write_text(json.dumps(results))
        # A rank that has finished must not exit while another is still connecting a group it created last: gloo
        # connects a new group's pairs without a closing handshake, so rank 0 could return from init_device_mesh, write
        # its results and close its sockets while rank 1 was still in connectFullMesh ("Connection closed by peer", seen
        # once in CI on a loaded 2-core machine). The barrier holds every rank until the last has finished its suite.
        dist.barrier()
    finally:
        dist.destroy_process_group()
