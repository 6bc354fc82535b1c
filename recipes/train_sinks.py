"""Recipe 2: packed fine-tuning of a learnable-sink model (gpt-oss-style: sinks, sliding window on alternate layers) on cuDNN.

    python3 recipes/train_sinks.py                        # a GPU: small preset, 200 steps; a CPU: tiny, 5 steps (fallback)
    python3 recipes/train_sinks.py --compare eager flex_attention flash_attention_4   # gpt-oss has no sdpa in transformers
    accelerate launch --multi_gpu --num_processes 2 recipes/train_sinks.py

The same engine and flags as recipe 1 (``recipes/train_sliding_window.py``) with ``--model gpt_oss`` as the default:
cuDNN trains the sinks (their gradient included) in fused kernels. Of the FlashAttention kernels only FlashAttention 4
(its CuTe kernels for sm90/sm100, PyPI ``flash-attn-4``) has a learnable-sink backward; FlashAttention 2 and 3 have none.
The other alternatives are eager (quadratic memory) and flex_attention (compiled, block masks rebuilt for each packed
layout). ``--compare flash_attention_4`` is reported as skipped, with the reason, where it is not installed.
"""

from cudnn_attention.recipes.common.errors import run_command
from cudnn_attention.recipes.common.hf_trainer import main as run_recipe

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict:
    """Run the recipe with ``argv`` (default: the command line); returns the metrics (also written to ``metrics.json``)."""
    return run_recipe(argv, recipe="train_sinks", family="gpt_oss")


if __name__ == "__main__":
    run_command(main)
