"""The fuzz generator and checker on CPU: seeded float32 cases served by the exact fallback, against float64.

Same code as the GPU fuzz (``fuzz_cases.py``, ``reference64.py``, ``fuzz_worker.py``, ``fuzz_runner.py`` in ``tests/support/``)
with the ``"cpu"`` profile: small shapes, float32 inputs, and a tight floor (2e-5 x |reference|) on top of twice float32's
own error.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from support.fuzz_cases import DENSE_LAYOUTS, PACKED_LAYOUTS, PROFILES, case_label, draw_case, run_case, summarize
from support.fuzz_runner import run_fuzz

REPRO = "python tests/support/fuzz_worker.py --seed {seed} --start {index} --count 1 --out - --device cpu --profile cpu"
SEED = int(os.environ.get("CUDNN_ATTENTION_FUZZ_SEED", "") or 7)
CASES = 120


@pytest.mark.parametrize("index", range(CASES))
def test_cpu_fuzz_case(index):
    case = draw_case(SEED, index, "cpu")
    record = run_case(case, "cpu")
    if not record["ok"]:
        report = summarize({index: record}, {index: case}, seed=SEED, requested=1, repro=REPRO)
        pytest.fail(report + "\n" + record.get("traceback", ""))
    assert record["path"].startswith("fallback"), record["path"]


def test_generator_covers_every_layout_and_option():
    cases = [draw_case(20250611, i, "gpu") for i in range(2000)]
    labels = Counter(case_label(c) for c in cases)
    for kind, layouts in (("dense", DENSE_LAYOUTS), ("padded", DENSE_LAYOUTS), ("packed", PACKED_LAYOUTS)):
        for layout in layouts:
            assert labels[f"{kind}/{layout}"] >= 20, labels
    assert {c["h_q"] // c["h_kv"] for c in cases} >= {1, 2, 4, 8, 16}
    assert any(c["h_kv"] == 1 and c["h_q"] > 1 for c in cases)
    assert {c["dtype"] for c in cases} == {"float16", "bfloat16"}
    assert min(c["d"] for c in cases) == 32 and max(c["d"] for c in cases) == 256 and all(c["d"] % 8 == 0 for c in cases)
    assert sum(c["d"] != c["d_v"] for c in cases) >= 50
    assert sum(c["scale"] == 0 for c in cases) >= 20 and sum((c["scale"] or 0) < 0 for c in cases) >= 20
    assert sum(c["sinks"] is not None for c in cases) >= 200
    assert {c["mask"] for c in cases} == {"none", "causal", "window"} and sum(c["bottom_right"] for c in cases) >= 500
    assert sum(c["window_size"][1] > 0 for c in cases) >= 100 and sum(c["window_size"][0] >= 0 for c in cases) >= 100
    padded = [c for c in cases if c["kind"] == "padded"]
    assert sum(0 in (c["seqlens_q"] or []) + (c["seqlens_kv"] or []) for c in padded) >= 50
    packed = [c for c in cases if c["kind"] == "packed"]
    assert sum(0 in c["lengths_q"] for c in packed) >= 50 and sum(1 in c["lengths_kv"] for c in packed) >= 50
    assert sum(sum(c["lengths_q"]) < c["t_q"] for c in packed) >= 200  # capacity tails
    assert sum(c["lengths_q"] != c["lengths_kv"] for c in packed) >= 200
    assert sum(c["causal"] and c["bottom_right"] for c in packed) >= 50 and sum(c["causal"] and not c["bottom_right"] for c in packed) >= 50
    # Few distinct graph signatures: families of FAMILY cases share one.
    assert draw_case(3, 0, "gpu")["d"] == draw_case(3, 1, "gpu")["d"] and draw_case(3, 0) == draw_case(3, 0)


def test_worker_processes_report_every_case_and_a_dying_one(tmp_path, monkeypatch):
    # The GPU driver, on CPU: two workers, one of which dies inside case 5 as a GPU fault would kill it.
    monkeypatch.setenv("CUDNN_ATTENTION_FUZZ_DIE_AT", "5")
    records, configs = run_fuzz(12, 2, SEED, tmp_path, device="cpu", profile="cpu", timeout=120, threads=1)
    assert sorted(records) == list(range(12))
    assert [i for i, r in records.items() if not r["ok"]] == [5]
    assert "worker died" in records[5]["exception"] and configs[5]["index"] == 5
    report = summarize(records, configs, seed=SEED, requested=12, repro="rerun {seed} {index}")
    assert "12 of 12 cases run, 1 failed" in report and "rerun 7 5" in report


def test_generator_draws_adversarial_rows_and_every_key_length_class():
    cases = [draw_case(20250611, i, "gpu") for i in range(4000)]
    adversarial = [c for c in cases if c["adversarial"]]
    assert 800 <= len(adversarial) <= 1200
    anti = [c for c in adversarial if c["adversarial"]["kind"] == "anti_aligned"]
    assert {c["adversarial"]["rows"] for c in anti} == {"all", "some", "one"} and {c["adversarial"]["target"] for c in anti} == {
        100.0,
        130.0,
    }
    assert {c["scale"] for c in adversarial if c["adversarial"]["kind"] != "anti_aligned"} >= {1e-4, 50.0}
    dense = [c for c in anti if c["kind"] != "packed"]
    assert {c["s_kv"] % 128 for c in dense} >= {0, 64, 72}  # multiples, 64 mod 128 (the erratum), others
    assert sum(c["s_kv"] % 128 == 64 and c["mask"] == "none" for c in dense) >= 20
    assert sum(c["s_q"] == 1 and c["s_kv"] >= 576 for c in dense) >= 10
    # A non-adversarial family is drawn as before the adversarial draw existed (its own random stream).
    plain = next(c for c in cases if not c["adversarial"] and c["kind"] == "dense")
    assert plain["s_q"] in PROFILES["gpu"]["seq"] and plain["s_kv"] in PROFILES["gpu"]["seq"]


def test_anti_aligned_rows_have_a_log_sum_exp_below_the_float32_overflow_threshold():
    import torch

    import cudnn_attention
    from support.fuzz_cases import build_call

    case = next(
        c
        for c in (draw_case(7, i, "cpu") for i in range(400))
        if c["adversarial"]
        and c["adversarial"]["kind"] == "anti_aligned"
        and c["adversarial"]["rows"] == "all"
        and not c["sinks"]
        and (c["scale"] is None or c["scale"] > 0)  # a negative scale turns anti-aligned rows into aligned ones (scores near +130)
    )
    _, args, kwargs = build_call(case, "cpu")
    _, lse = (cudnn_attention.attention if case["kind"] != "packed" else cudnn_attention.varlen_attention)(
        *args, **{**kwargs, "return_lse": True}
    )
    finite = lse[torch.isfinite(lse)]
    assert finite.numel() and finite.max() < -88.7, (case, finite.max())
