"""Recipe 1: packed fine-tuning of a sliding-window model (Mistral-style) on cuDNN attention, with transformers' Trainer.

    python3 recipes/train_sliding_window.py                       # a GPU: small preset, 200 steps; a CPU: tiny, 5 steps (fallback)
    python3 recipes/train_sliding_window.py --compare sdpa        # same steps on sdpa: loss difference, speedup, memory
    python3 recipes/train_sliding_window.py --size long           # documents of 16k-32k tokens, attention-bound (a GPU of 32 GiB)
    python3 recipes/train_sliding_window.py --checkpoint DIR --dataset data.jsonl   # your local model and data
    python3 recipes/train_sliding_window.py --report_to tensorboard --gradient_checkpointing   # any TrainingArguments flag
    accelerate launch --multi_gpu --num_processes 2 recipes/train_sliding_window.py      # DDP
    accelerate launch --config_file recipes/accelerate_fsdp.yaml recipes/train_sliding_window.py   # FSDP

Documents of varying length are packed into one row per step by ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
(no padding) and the model runs ``attn_implementation="cudnn"``. Each run writes ``metrics.json`` and ``loss.png`` into a
folder of its own, ``runs/train_sliding_window/<date>_<time>/`` (or ``--output_dir``).
"""

from cudnn_attention.recipes.common.errors import run_command
from cudnn_attention.recipes.common.hf_trainer import main as run_recipe

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe with ``argv`` (default: the command line); returns the metrics (also written to ``metrics.json``)."""
    return run_recipe(argv, recipe="train_sliding_window", family="mistral")


if __name__ == "__main__":
    run_command(main)
