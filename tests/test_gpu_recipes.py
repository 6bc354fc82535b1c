"""The recipes on a GPU (small preset, bf16): cuDNN serves every attention call in strict mode, and the loss curve
against eager stays within what sdpa vs eager shows. About 2 minutes on an H200 for the whole file."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))

pytestmark = pytest.mark.gpu
STEPS = 20
# Eager materializes every (query, key) score: 4096 tokens per step keeps it small on the small preset.
COMPARE_TOKENS = "4096"


def _served_by_cudnn_only(run: dict) -> None:
    stats = run["run"]["stats"]
    assert stats["cudnn_forward"] > 0 and stats["cudnn_backward"] > 0, stats
    assert not stats["fallback_forward"] and not stats["fallback_backward"], stats
    assert run["mfu"] is not None and 0 < run["mfu"] < 1, run["mfu"]  # the dense bf16 peak is known (H100/H200/A100)
    assert run["peak_memory_gib"] > 0


@pytest.mark.parametrize("recipe", ["train_sliding_window", "train_sinks"])
def test_trainer_recipe_runs_on_cudnn_in_strict_mode(recipe, tmp_path):
    payload = __import__(recipe).main(["--size", "small", "--steps", str(STEPS), "--strict", "--output_dir", str(tmp_path)])
    run = payload["runs"]["cudnn"]
    assert run["steps"] == STEPS and run["final_loss"] < run["first_loss"]
    _served_by_cudnn_only(run)
    assert (tmp_path / "loss.png").exists() and (tmp_path / "metrics.json").exists()


def test_lightning_recipe_runs_on_cudnn_in_strict_mode(tmp_path):
    import train_lightning

    payload = train_lightning.main(["--model.size=small", "--model.strict=true", f"--trainer.max_steps={STEPS}",
                                    f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"])  # fmt: skip
    run = payload["runs"]["cudnn"]
    assert run["steps"] == STEPS and payload["config"]["precision"] == "bf16-true"
    _served_by_cudnn_only(run)


def test_sliding_window_loss_curve_against_eager_within_sdpa_vs_eager(tmp_path):
    import train_sliding_window

    common = ["--size", "small", "--steps", str(STEPS), "--tokens_per_step", COMPARE_TOKENS]
    payload = train_sliding_window.main([*common, "--compare", "eager", "--output_dir", str(tmp_path / "cudnn")])
    sdpa = train_sliding_window.main([*common, "--attn", "sdpa", "--output_dir", str(tmp_path / "sdpa")])
    eager_losses = payload["runs"]["eager"]["run"]["losses"]
    sdpa_vs_eager = max(abs(a - b) for a, b in zip(sdpa["runs"]["sdpa"]["run"]["losses"], eager_losses, strict=True))
    bound = 2 * sdpa_vs_eager + 2e-3  # same seed and batches: only bf16 rounding differs between the three
    assert payload["comparison"]["loss_max_abs_diff"] <= bound, (payload["comparison"], sdpa_vs_eager)


def test_sinks_loss_curve_against_eager(tmp_path):
    import train_sinks

    args = ["--size", "small", "--steps", str(STEPS), "--tokens_per_step", COMPARE_TOKENS, "--compare", "eager"]
    comparison = train_sinks.main([*args, "--output_dir", str(tmp_path)])["comparison"]
    # No sdpa for gpt-oss in transformers; bf16 top-2 routing can flip on near ties, hence a looser bound than mistral's.
    assert comparison["loss_max_rel_diff"] < 2e-2, comparison
