"""Quick start: cuDNN attention on whatever this machine has, checked against PyTorch's own SDPA.

    python recipes/quickstart.py

On a GPU it runs a causal GQA attention forward and backward through cuDNN; on a CPU the same
call runs on the exact PyTorch fallback and says so. Either way it prints the largest difference
from ``torch.nn.functional.scaled_dot_product_attention`` and which path served the calls.
"""

import torch
import torch.nn.functional as F

import cudnn_attention


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    batch, heads_q, heads_kv, seq, head_dim = 2, 16, 4, 1024, 128
    q = torch.randn(batch, heads_q, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, heads_kv, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, heads_kv, seq, head_dim, device=device, dtype=dtype, requires_grad=True)

    out = cudnn_attention.attention(q, k, v, causal=True)
    out.float().square().mean().backward()
    grads = [t.grad.clone() for t in (q, k, v)]

    group = heads_q // heads_kv
    expected = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1), is_causal=True)
    print(f"device {device}, dtype {dtype}: max |out - torch sdpa (fp32)| = {(out.float() - expected).abs().max().item():.4f}")
    print(f"gradient norms: dq {grads[0].float().norm():.3e}, dk {grads[1].float().norm():.3e}, dv {grads[2].float().norm():.3e}")
    print("served:", cudnn_attention.stats())


if __name__ == "__main__":
    main()
