"""``--context_parallel 2`` on a CPU: the Trainer recipes' flag starts 2 gloo processes on the tiny preset, reports the metrics
every recipe reports, and its first step's loss (before any update) is the single-process loss of the same pack."""

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from cudnn_attention.recipes import train_sliding_window
from cudnn_attention.recipes.common import PackedCollator, RecipeError, build_dataset, build_model, load_tokenizer, model_shape

pytestmark = [pytest.mark.no_gpu, pytest.mark.skipif(sys.platform == "win32", reason="gloo process groups")]
STEPS = 2


def _first_pack_loss() -> float:
    """The loss of the run's first pack in one process, with the run's initial weights (seed 0, the tiny preset)."""
    tokenizer = load_tokenizer(tokenizer=None, checkpoint=None)
    dataset = build_dataset(
        tokenizer=tokenizer, dataset=None, text_field="text", tokens_per_step=1024, min_doc_tokens=16, max_doc_tokens=512, seed=0
    )
    model = build_model(
        attn_implementation="cudnn",
        family="mistral",
        shape=model_shape(family="mistral", size="tiny"),
        vocab_size=tokenizer.vocab_size,
        max_positions=4096,
        tokenizer=tokenizer,
        device="cpu",
        dtype=torch.float32,
        seed=0,
    )
    batch = PackedCollator()([dataset[0]])
    batch.pop("recipe_stats")
    with torch.no_grad():
        return model(**batch).loss.item()


def test_context_parallel_2_trains_on_two_gloo_processes_and_starts_from_the_one_process_loss(tmp_path):
    payload = train_sliding_window.main(["--context_parallel", "2", "--max_steps", str(STEPS), "--output_dir", str(tmp_path)])
    assert json.loads((tmp_path / "metrics.json").read_text())["runs"].keys() == {"cudnn"}
    assert (tmp_path / "loss.png").stat().st_size > 0
    run = payload["runs"]["cudnn"]
    assert run["run"]["distributed"] == "context parallel x 2" and run["run"]["world_size"] == 1  # one pack per step
    assert run["real_tokens"] == STEPS * 1024 and run["tokens_per_s"] > 0
    losses = run["run"]["losses"]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert abs(losses[0] - _first_pack_loss()) <= 1e-5 * abs(losses[0]), losses
    # every attention call of both ranks: 2 layers x 2 steps on each rank's exact fallback (counted per process: rank 0's)
    assert run["run"]["stats"]["fallback_forward"] == {"cpu tensors": 2 * STEPS}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--compare", "eager"], "does not take --compare"),
        (["--gradient_accumulation_steps", "2"], "does not take --gradient_accumulation_steps"),
        (["--context_parallel", "0"], "pass 1 or more"),
    ],
)
def test_what_context_parallel_cannot_run_with_is_refused_before_it_starts(extra, message, tmp_path):
    with pytest.raises(RecipeError, match=message):
        train_sliding_window.main(["--context_parallel", "2", "--max_steps", "1", "--output_dir", str(tmp_path), *extra])
