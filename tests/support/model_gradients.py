"""Whole-model gradient comparison shared by the GPU tests: cuDNN in bf16 against eager in fp32, within eager bf16's own error."""

from cudnn_attention.recipes.common.gradients import parameter_gradients, recipe_batches, recipe_gradients, relative_error
from support.tolerances import noise_bound

__all__ = ["gradient_mismatches", "parameter_gradients", "recipe_batches", "recipe_gradients", "relative_error"]


def gradient_mismatches(cudnn_bf16: dict, eager_fp32: dict, eager_bf16: dict) -> list[str]:
    """Parameters whose cuDNN gradient is further from fp32 than twice eager bf16's (plus 1e-3), as messages.

    Relative error of the whole tensor, not its largest element: a gradient sums over every token, and one
    element's bf16 error swings with how each run's other matmuls round; gpt-oss's expert biases once went
    2.3 times eager's largest-element error. A wrong dQ (rows shifted by one token) makes the embedding's
    whole-tensor error 10 to 20 times eager's.
    """
    if set(cudnn_bf16) != set(eager_fp32):
        return [f"parameters with gradients differ: {sorted(set(cudnn_bf16) ^ set(eager_fp32))}"]
    failures = []
    for parameter, want in eager_fp32.items():
        err, base = relative_error(cudnn_bf16[parameter], want), relative_error(eager_bf16[parameter], want)
        if err > noise_bound(base, 1.0):  # relative errors: the slack is 1e-3 of a relative error of 1
            failures.append(f"{parameter}: cudnn relative error {err:.3g} > 2 x eager bf16's {base:.3g} + 1e-3")
    return failures
