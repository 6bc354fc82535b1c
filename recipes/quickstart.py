"""Quick start: cuDNN attention on whatever this machine has, checked against PyTorch.

    python3 recipes/quickstart.py

On a GPU it runs a causal GQA attention forward and backward through cuDNN in bf16; on a CPU the same call runs on
the exact PyTorch fallback in fp32 and says so. The output and the gradients of q, k and v are compared with a float64
reference, next to what torch's own SDPA in the same dtype gets: cudnn_attention passes when its error is within
twice SDPA's (plus a small floor), the rule the project's tests use. Prints a verdict and which path served the calls;
exits with status 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.nn.functional as F

import cudnn_attention
from cudnn_attention.recipes.common.errors import OneLineArgumentParser
from cudnn_attention.recipes.common.reporting import fallback_reasons

__all__ = ["check", "main"]


def _sdpa(q, k, v):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)


def _output_and_grads(attention, q, k, v, grad_out) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def check(*, batch: int = 2, heads: int = 16, kv_heads: int = 4, seq: int = 1024, head_dim: int = 128, device: str | None = None) -> dict:
    """Largest error of cudnn_attention's output, dq, dk and dv against float64, beside torch SDPA's in the same dtype.

    Returns ``{"device", "dtype", "errors": {name: (cudnn error, sdpa error)}, "passed", "stats"}``.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, h, seq, head_dim, generator=generator).to(device) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(batch, heads, seq, head_dim, generator=generator).to(device)
    cudnn_attention.reset_stats()
    with warnings.catch_warnings():  # which path served is the verdict's to say, with the counters
        warnings.simplefilter("ignore", cudnn_attention.CudnnAttentionFallbackWarning)
        got = _output_and_grads(lambda *t: cudnn_attention.attention(*t, causal=True), *(t.to(dtype) for t in (q, k, v)), grad_out)
    stats = cudnn_attention.stats()
    sdpa = _output_and_grads(_sdpa, *(t.to(dtype) for t in (q, k, v)), grad_out)
    reference = _output_and_grads(_sdpa, *(t.double() for t in (q, k, v)), grad_out)
    errors = {}
    for name, mine, theirs, exact in zip(("out", "dq", "dk", "dv"), got, sdpa, reference, strict=True):
        errors[name] = ((mine.double() - exact).abs().max().item(), (theirs.double() - exact).abs().max().item())
    # Within twice the error of torch's own kernel in the same dtype, plus a floor for where that error is ~0.
    floor = 1e-3 if dtype == torch.bfloat16 else 1e-5
    passed = all(mine <= 2 * theirs + floor for mine, theirs in errors.values())
    return {"device": device, "dtype": dtype, "errors": errors, "passed": passed, "stats": stats}


def _served(stats: dict) -> str:
    if stats["cudnn_forward"] and stats["cudnn_backward"]:
        return f"cuDNN ({stats['cudnn_forward']} forward, {stats['cudnn_backward']} backward call)"
    reasons = ", ".join(fallback_reasons(stats)) or "unknown"
    return f"the exact PyTorch fallback, not cuDNN ({reasons})"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        # argparse puts this message after "argument --seq:"; an empty sequence has no error to measure.
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of tokens: pass 1 or more")
    return value


def main(argv: list[str] | None = None) -> bool:
    """Run :func:`check`, print the table and the verdict; returns whether it passed."""
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--seq", type=_positive, default=1024, help="tokens per sequence (2 sequences, 16 query / 4 key-value heads, D 128)"
    )
    args = parser.parse_args(argv)
    result = check(seq=args.seq)
    where = torch.cuda.get_device_name() if result["device"] == "cuda" else "CPU"
    print(f"causal GQA attention, 2 x {args.seq} tokens, 16/4 heads, D 128, {str(result['dtype']).removeprefix('torch.')} on {where}")
    print(f"{'':4} {'max |error| vs float64':>24} {'torch SDPA, same dtype':>24}")
    for name, (mine, theirs) in result["errors"].items():
        print(f"{name:4} {mine:>24.3g} {theirs:>24.3g}")
    verdict = "PASS" if result["passed"] else "FAIL (error above twice torch SDPA's)"
    print(f"{verdict}: served by {_served(result['stats'])}")
    return result["passed"]


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
