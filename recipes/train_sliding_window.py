"""Recipe 1: packed fine-tuning of a sliding-window model (Mistral-style) on cuDNN attention, with transformers' Trainer.

    python recipes/train_sliding_window.py                       # a GPU: small preset, 200 steps; a CPU: tiny, 5 steps (fallback)
    python recipes/train_sliding_window.py --compare sdpa        # same steps on sdpa: loss difference, speedup, memory
    python recipes/train_sliding_window.py --size long           # documents of 4k-32k tokens, attention-bound
    python recipes/train_sliding_window.py --checkpoint DIR --dataset data.jsonl   # your local model and data
    accelerate launch --multi_gpu --num_processes 2 recipes/train_sliding_window.py      # DDP
    accelerate launch --config_file recipes/accelerate_fsdp.yaml recipes/train_sliding_window.py   # FSDP

Documents of varying length are packed into one row per step by ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
(no padding) and the model runs ``attn_implementation="cudnn"``. Writes ``runs/train_sliding_window/metrics.json`` and ``loss.png``.
"""

from common.hf_trainer import main as run_recipe

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe with ``argv`` (default: the command line); returns the metrics (also written to ``metrics.json``)."""
    return run_recipe(argv, recipe="train_sliding_window", model="mistral")


if __name__ == "__main__":
    main()
