"""benchmarks/end_to_end.py: its ``--quick`` run end to end, the profile arithmetic, the packing, and the gpt-oss masks.

Each check runs in a child interpreter that imports the script as its own run would (``support.benchmark_scripts``), never
in the test process: the quick run compares what ``main`` returned with what it wrote.
"""

import json
import math

import pytest
import torch

from support.benchmark_scripts import check_in_script

SETUP_NAMES = ["llama", "gpt-oss", "long"]  # end_to_end.SETUPS; the quick run checks that the script still has exactly these


def _expected_error(row: dict) -> bool:
    """The rows a run may fail honestly: gpt-oss has no sdpa; flex_attention has no backward (nor sinks) on a CPU;
    flash_attention_4 runs only where flash-attn-4 is installed, on an sm90/sm100 GPU."""
    if row["config"] == "gpt-oss" and row["implementation"] == "sdpa":
        return row["error"].startswith("not supported")
    if row["implementation"] == "flash_attention_4":
        return "flash_attention_4" in row["error"] or row["error"].startswith("not supported")
    return row["implementation"] == "flex_attention" and not torch.cuda.is_available()


def test_quick_run_reports_every_implementation(tmp_path):
    code = """
        import json
        import sys

        import torch

        torch.set_num_threads(1)  # tensors of 256 x 64: OpenMP threads only spin-wait against each other on a busy 2-core runner
        rows = end_to_end.main(["--quick", "--out", sys.argv[1]])
        print(json.dumps({"rows": rows, "setups": list(end_to_end.SETUPS), "implementations": end_to_end.IMPLEMENTATIONS,
                          "both_packings": end_to_end.BOTH_PACKINGS}, default=str))
    """
    returned = json.loads(check_in_script("end_to_end", code, str(tmp_path)).splitlines()[-1])
    payload = json.loads((tmp_path / "end_to_end.json").read_text())
    table = (tmp_path / "end_to_end.md").read_text()
    assert payload["rows"] == returned["rows"]
    assert returned["setups"] == SETUP_NAMES == list(payload["setups"])
    for config in SETUP_NAMES:
        found = {(r["implementation"], r["packing"]) for r in payload["rows"] if r["config"] == config}
        expected = {(impl, "position_ids") for impl in returned["implementations"]}
        expected |= {(impl, "flash kwargs") for impl in returned["both_packings"]}
        assert found == expected, config
    for row in payload["rows"]:
        assert f"| {row['config']} | {row['implementation']} | {row['packing']} |" in table
        if "error" in row:
            assert _expected_error(row), row
            continue
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0, row
        shares = [row["profile"][f"{what}_pct"] for what in ("attention", "copies", "other", "idle")]
        assert all(math.isfinite(share) and share >= 0 for share in shares), row
        assert row["profile"]["top_kernels"], row
    measured = [r for r in payload["rows"] if "error" not in r]
    assert {r["implementation"] for r in measured} >= {"cudnn", "eager"}
    # every measured row of a configuration with an sdpa row is compared with it
    assert all("vs_sdpa_tokens" in r for r in measured if r["config"] != "gpt-oss")
    if not torch.cuda.is_available():
        assert "exact PyTorch fallback" in table
        assert all(r["note"].startswith("exact fallback") for r in payload["rows"] if r["implementation"] == "cudnn")


def test_summarize_counts_overlaps_once_and_idle_against_the_step():
    code = """
        import pytest

        kernels = [
            ("cudnn_generated_fort_native_sdpa_sm90_fprop", 0.0, 10.0),
            ("void at::native::direct_copy_kernel_cuda", 5.0, 14.0),  # overlaps the first on another stream
            ("sm90_xmma_gemm_bf16bf16", 20.0, 30.0),
            ("Memcpy DtoD (Device -> Device)", 30.0, 32.0),
            ("sm90_xmma_gemm_bf16bf16", 32.0, 40.0),
        ]
        summary = end_to_end.summarize(kernels, 50.0, top=2)
        assert summary["attention_pct"] == pytest.approx(20.0), summary
        assert summary["copies_pct"] == pytest.approx(22.0), summary
        assert summary["other_pct"] == pytest.approx(36.0), summary
        assert summary["busy_ms"] == pytest.approx(0.034), summary  # [0, 14] and [20, 40]
        assert summary["idle_pct"] == pytest.approx(32.0), summary
        assert [(k["name"], k["calls"], k["category"]) for k in summary["top_kernels"]] == [
            ("sm90_xmma_gemm_bf16bf16", 2, "other"),
            ("cudnn_generated_fort_native_sdpa_sm90_fprop", 1, "attention"),
        ], summary
    """
    check_in_script("end_to_end", code)


@pytest.mark.parametrize("name", SETUP_NAMES)
def test_document_lengths_fill_each_step_within_range(name):
    code = """
        import sys

        import torch

        setup = end_to_end.SETUPS[sys.argv[1]]
        generator = torch.Generator().manual_seed(0)
        for _ in range(50):
            lengths = end_to_end.document_lengths(setup, generator)
            assert sum(lengths) == setup.tokens, lengths
            shortest, longest = setup.doc_range
            rest = list(lengths)
            if setup.lead_document:
                rest.remove(setup.lead_document)
            assert all(shortest <= n <= longest for n in rest), lengths
    """
    check_in_script("end_to_end", code, name)


def test_gpt_oss_document_masks_keep_documents_apart():
    """Eager on the packed row gives each document's own logits: the benchmark's gpt-oss builds its masks from
    position_ids (the recipes' packing_safe_masks; transformers' gpt-oss builds them without position_ids)."""
    code = """
        import itertools

        import torch

        setup = end_to_end.quick(end_to_end.SETUPS["gpt-oss"])
        model = end_to_end.build_model(setup, "cpu").float().eval()
        batch = end_to_end.make_batches(setup, 1, "cpu")[0]
        positions = batch["position_ids"]
        starts = [*(positions[0] == 0).nonzero().flatten().tolist(), positions.shape[1]]
        assert len(starts) > 2, starts  # several documents
        with torch.no_grad():
            alone = torch.cat([model(input_ids=batch["input_ids"][:, a:b]).logits for a, b in itertools.pairwise(starts)], dim=1)
            packed = model(input_ids=batch["input_ids"], position_ids=positions).logits
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    """
    check_in_script("end_to_end", code)


def test_graphs_built_during_the_timed_steps_are_noted():
    # A timed batch with a document count or length the warm-up did not see builds graphs inside the timing; the row says so.
    code = """
        from cudnn_attention import policy

        setup = end_to_end.quick(end_to_end.SETUPS["llama"])
        model = end_to_end.build_model(setup, "cpu")
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        batches = end_to_end.make_batches(setup, 4, "cpu")
        step = end_to_end.train_step
        calls = []

        def step_that_builds(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # the second timed step (one warm-up step first)
                policy.note_graph_build("backward", 0.25)
            return step(*args, **kwargs)

        end_to_end.train_step = step_that_builds  # this interpreter ends with the check: nothing to put back
        row = end_to_end.run_one(model, initial, setup, "cudnn", "position_ids", batches, warmup=1, profile=False, device="cpu")
        assert "1 cuDNN graphs built during the timed steps (0.25 s)" in row["note"], row["note"]
    """
    check_in_script("end_to_end", code)


def test_the_shape_pass_runs_each_timed_batch_once_on_copies_before_the_timing():
    # Copies: what is kept on a batch's own tensors (the documents read from position_ids) must still be paid in the timed steps.
    code = """
        import torch

        setup = end_to_end.quick(end_to_end.SETUPS["llama"])
        model = end_to_end.build_model(setup, "cpu")
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        batches = end_to_end.make_batches(setup, 5, "cpu")
        seen = []
        real_forward = model.forward

        def forward(**inputs):
            seen.append(inputs["position_ids"])
            return real_forward(**inputs)

        model.forward = forward  # this interpreter ends with the check: nothing to put back
        end_to_end.run_one(model, initial, setup, "cudnn", "position_ids", batches, warmup=1, profile=False, device="cpu")
        timed = batches[1:-1]
        # warm-up step, the shape pass over copies of the 3 timed batches, then the 3 timed steps themselves
        assert len(seen) == 1 + 2 * len(timed), len(seen)
        for copy, batch in zip(seen[1 : 1 + len(timed)], timed):
            assert copy is not batch["position_ids"] and torch.equal(copy, batch["position_ids"])
        assert [t is b["position_ids"] for t, b in zip(seen[1 + len(timed) :], timed)] == [True] * len(timed)
    """
    check_in_script("end_to_end", code)
