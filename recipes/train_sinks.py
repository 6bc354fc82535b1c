"""Recipe 2: packed fine-tuning of a learnable-sink model (gpt-oss-style: sinks, sliding window on alternate layers) on cuDNN.

    python recipes/train_sinks.py                        # a GPU: small preset, 200 steps; a CPU: tiny, 5 steps (fallback)
    python recipes/train_sinks.py --compare eager        # gpt-oss has no sdpa in transformers; eager and flex_attention compare
    accelerate launch --multi_gpu --num_processes 2 recipes/train_sinks.py

The same engine and flags as recipe 1 (``recipes/train_sliding_window.py``) with ``--model gpt_oss`` as the default:
cuDNN trains the sinks (their gradient included) in fused kernels; FlashAttention 2/3/4 have no sink backward, so without it
the alternatives are eager (quadratic memory) and flex_attention (compiled, block masks rebuilt for each packed layout).
"""

from common.hf_trainer import main as run_recipe

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe with ``argv`` (default: the command line); returns the metrics (also written to ``metrics.json``)."""
    return run_recipe(argv, recipe="train_sinks", model="gpt_oss")


if __name__ == "__main__":
    main()
