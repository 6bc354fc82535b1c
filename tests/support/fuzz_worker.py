"""One fuzz worker: run cases ``start .. start + count - 1`` of a seeded run and log each as JSON lines.

    python tests/support/fuzz_worker.py --seed 1234 --start 0 --count 250 --out results.jsonl [--device cuda] [--profile gpu]

Each case writes a ``{"event": "start", ...}`` line (with its full config) before it runs and a
``{"event": "end", ...}`` line after, both flushed and fsynced, so a process killed by a GPU fault
leaves the config of the case that killed it. After a case that raised on a GPU, the worker checks
that the CUDA context still works and exits with status 3 if not (CUDA errors poison a process);
the parent then records that case as a crash and starts a new worker after it. ``--out -`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`

POISONED_EXIT = 3


def _emit(stream, record: dict) -> None:
    stream.write(json.dumps(record, default=str) + "\n")
    stream.flush()
    try:
        os.fsync(stream.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _passes_after_on_poisoned_memory() -> None:
    """Every packed call that does not cover every token sets its unwritten rows after the kernels whatever its size
    (``launch._PASS_AFTER_MIN_ELEMENTS`` 0, where most fuzz cases would be below it), on outputs that start as NaN."""
    import pytest

    from cudnn_attention import launch
    from support.fill_spy import record_fills

    patch = pytest.MonkeyPatch()
    patch.setattr(launch, "_PASS_AFTER_MIN_ELEMENTS", 0)
    record_fills(patch, poison=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--start", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default="gpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    import cudnn_attention
    from support.fuzz_cases import draw_case, run_case

    torch.set_num_threads(args.threads)
    if os.environ.get("CUDNN_ATTENTION_FUZZ_PASSES_AFTER"):
        _passes_after_on_poisoned_memory()
    warnings.simplefilter("ignore", cudnn_attention.CudnnAttentionFallbackWarning)
    stream = sys.stdout if args.out == "-" else open(args.out, "a", encoding="utf-8")
    for index in range(args.start, args.start + args.count):
        case = draw_case(args.seed, index, args.profile)
        _emit(stream, {"event": "start", "index": index, "config": case, "pid": os.getpid()})
        if str(index) == os.environ.get("CUDNN_ATTENTION_FUZZ_DIE_AT"):  # test hook: die mid-case like a GPU fault
            os._exit(7)
        record = run_case(case, args.device)
        _emit(stream, {"event": "end", **record})
        if "exception" in record and args.device.startswith("cuda"):
            try:
                torch.cuda.synchronize()
                torch.zeros(1, device=args.device).add_(1).item()
            except Exception as exc:  # noqa: BLE001
                _emit(stream, {"event": "poisoned", "index": index, "error": f"{type(exc).__name__}: {exc}"[:1000]})
                return POISONED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
