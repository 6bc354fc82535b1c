"""The recipes on a GPU (small preset, bf16): cuDNN serves every attention call in strict mode, and the loss curve
against eager stays within what sdpa vs eager shows. A few minutes on an H200 for the whole file."""

import importlib

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from support.model_gradients import gradient_mismatches, recipe_batches, recipe_gradients  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = 20
# Eager materializes every (query, key) score: 4096 tokens per step keeps it small on the small preset.
COMPARE_TOKENS = "4096"
SEEDS = (0, 1, 2, 3, 4)  # model init and batch order


def _recipe(name: str):
    return importlib.import_module(f"cudnn_attention.recipes.{name}")


def _served_by_cudnn_only(run: dict) -> None:
    stats = run["run"]["stats"]
    assert stats["cudnn_forward"] > 0 and stats["cudnn_backward"] > 0, stats
    assert not stats["fallback_forward"] and not stats["fallback_backward"], stats
    assert run["mfu"] is not None and 0 < run["mfu"] < 1, run["mfu"]  # the dense bf16 peak is known (H100/H200/A100)
    assert run["peak_memory_gib"] > 0


@pytest.mark.parametrize("recipe", ["train_sliding_window", "train_sinks"])
def test_trainer_recipe_runs_on_cudnn_in_strict_mode(recipe, tmp_path):
    payload = _recipe(recipe).main(["--size", "small", "--max_steps", str(STEPS), "--strict", "--output_dir", str(tmp_path)])
    run = payload["runs"]["cudnn"]
    assert run["steps"] == STEPS and run["final_loss"] < run["first_loss"]
    _served_by_cudnn_only(run)
    assert (tmp_path / "loss.png").exists() and (tmp_path / "metrics.json").exists()


def test_lightning_recipe_runs_on_cudnn_in_strict_mode(tmp_path):
    payload = _recipe("train_lightning").main(
        [
            "--model.size=small",
            "--model.strict=true",
            f"--trainer.max_steps={STEPS}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
        ]
    )
    run = payload["runs"]["cudnn"]
    assert run["steps"] == STEPS and payload["config"]["precision"] == "bf16-true"
    _served_by_cudnn_only(run)


@pytest.mark.parametrize(("recipe", "fused"), [("train_sliding_window", "sdpa"), ("train_sinks", "flex_attention")])
def test_loss_curve_against_eager_within_what_another_fused_kernel_shows(recipe, fused, tmp_path):
    # Same seed, weights and batches: the runs differ only in how each kernel rounds in bf16, and training amplifies
    # that (for gpt-oss, bf16 top-2 expert routing flips on near ties). What another fused kernel shows against eager
    # in the same run is the yardstick: sdpa for Mistral, flex_attention for gpt-oss (transformers has no sdpa for it).
    # A routing flip lands at a random step for any kernel, so one seed is a noisy verdict: over the first 20 steps
    # flex_attention was 0.0054 / 0.0223 / 0.0139 from eager for seeds 0 / 1 / 2, and the sink fold, which rounds as
    # transformers' flex_attention sinks do, 0.106 / 0.0220 / 0.0131 (cuDNN's sink engine 0.023 / 0.008 / 0.008). So,
    # as in the loss suite (benchmarks/recipe_training.py), the verdict compares means over seeds, with a floor of 1%
    # of the first loss (about 0.058). cuDNN's wrong dQ for gpt-oss's head-major q put one seed 0.372 from eager.
    # Five seeds, not three: with the eager experts loop (recipes' training_experts) seed 0 strays early for the fold in
    # every run (0.145 and 0.115 in two runs, flex_attention 0.041), which alone carried a three-seed mean past the floor
    # (0.0582 against 0.0580). Five seeds, H200: fold 0.115 / 0.022 / 0.011 / 0.102 / 0.012 (mean 0.053), cuDNN's sink
    # engine 0.030 / 0.012 / 0.007 / 0.072 / 0.019 (0.028), flex_attention 0.041 / 0.016 / 0.018 / 0.040 / 0.032 (0.029).
    args = ["--size", "small", "--max_steps", str(STEPS), "--tokens_per_step", COMPARE_TOKENS, "--compare", "eager", fused]
    distances, first_eager = {"cudnn": [], fused: []}, []
    for seed in SEEDS:
        payload = _recipe(recipe).main([*args, "--seed", str(seed), "--output_dir", str(tmp_path / f"seed{seed}")])
        for name, runs in distances.items():
            runs.append(payload["loss_max_abs_diff_vs_eager"][name])
        first = {name: run["first_loss"] for name, run in payload["runs"].items()}
        first_eager.append(first["eager"])
        # The first loss comes before any update: the forward alone, before training amplifies any difference.
        assert abs(first["cudnn"] - first["eager"]) <= 2 * abs(first[fused] - first["eager"]) + 2e-3 * abs(first["eager"]), (seed, first)
    mean = {name: sum(runs) / len(runs) for name, runs in distances.items()}
    assert mean["cudnn"] <= max(2 * mean[fused] + 2e-3, 0.01 * min(first_eager)), distances


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_one_recipe_batch_gives_eager_gradients_for_every_parameter(family):
    # The tiny-model gradient test (test_gpu_hf.py) at the recipes' scale: the small preset (Mistral D 128, window 1024;
    # gpt-oss D 64, window 128, sinks) on 4096 packed tokens of 256-4096-token documents, the shapes, windows and graph
    # bounds the loss curves come from. eager keeps packed documents apart through position_ids.
    import torch

    import cudnn_attention

    (batch,) = recipe_batches(size="small", tokens=int(COMPARE_TOKENS), count=1, device="cuda")
    implementations = [("cudnn", torch.bfloat16), ("eager", torch.float32), ("eager", torch.bfloat16)]
    grads = recipe_gradients(family=family, size="small", batch=batch, implementations=implementations, device="cuda")
    stats = cudnn_attention.stats()  # cuDNN itself served the gradients compared, not the exact fallback
    assert stats["cudnn_backward"] > 0 and not stats["fallback_forward"] and not stats["fallback_backward"], stats
    mismatches = gradient_mismatches(grads["cudnn", torch.bfloat16], grads["eager", torch.float32], grads["eager", torch.bfloat16])
    assert not mismatches, "\n".join(mismatches)


def test_quickstart_passes_on_cudnn():
    # The quick start's verdict on a GPU: output and gradients within twice torch SDPA's bf16 error, served by cuDNN.
    from cudnn_attention.recipes import quickstart

    result = quickstart.check()
    assert result["passed"], result["errors"]
    stats = result["stats"]
    assert stats["cudnn_forward"] and stats["cudnn_backward"] and not stats["fallback_forward"], stats
