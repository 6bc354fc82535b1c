"""torch's own cuDNN attention (``SDPBackend.CUDNN_ATTENTION``) against float64, on whichever cuDNN is loaded: does the
user's torch still run right when a newer cuDNN is loaded under it (``cudnn-attention doctor`` tells how to get one)?

    python3 benchmarks/torch_sdpa_cudnn.py --out $OUT/919                # torch's pinned cuDNN
    source <(bash benchmarks/carry_cudnn.sh env) && python3 benchmarks/torch_sdpa_cudnn.py --out $OUT/928

torch's test files do not ship in its wheel, so this is the stand-in for its own SDPA tests: a grid of shapes (B, H,
S_q, S_kv, D, causal, bf16 and fp16, an additive float mask, non-contiguous inputs, GQA through ``enable_gqa``) and the
adversarial rows of ``tests/support/adversarial.py`` (every score of a row near -100 below zero; cuDNN < 9.26's Hopper
backward writes NaN into dQ there when S_kv is 64 mod 128, errata entry ``dq-nan-kv-64-mod-128``). Each row runs
forward and backward through torch's cuDNN backend alone and through its math backend at the same precision, both
against a float64 math reference. A row passes when every tensor's error is within FlashAttention's rule: at most
2x the math backend's error plus 1e-3 of the tensor's largest magnitude (a NaN or Inf fails it: no row of the grid
has one in float64). A row torch does not serve on cuDNN (it raises "no available kernel") says so. Writes ``torch_sdpa_cudnn.md``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' adversarial rows: `support.adversarial`

TENSORS = ("out", "dq", "dk", "dv")


def cases():
    """(label, B, H, H_kv, S_q, S_kv, D, causal, dtype, extra) for every row of the grid."""
    rows = []
    for S, D, causal, dtype in itertools.product((64, 192, 576, 1000, 2048), (64, 128), (False, True), (torch.bfloat16, torch.float16)):
        rows.append((f"S {S}", 2, 8, 8, S, S, D, causal, dtype, "plain"))
    for S_q, S_kv in ((1, 4096), (128, 1088), (1088, 320)):
        rows.append((f"S_q {S_q} S_kv {S_kv}", 1, 8, 8, S_q, S_kv, 128, False, torch.bfloat16, "plain"))
    rows.append(("GQA 16/4", 2, 16, 4, 1024, 1024, 128, True, torch.bfloat16, "gqa"))
    rows.append(("float mask", 2, 8, 8, 512, 512, 64, False, torch.bfloat16, "mask"))
    rows.append(("transposed (B, S, H, D) views", 2, 8, 8, 1024, 1024, 128, True, torch.bfloat16, "bshd"))
    rows.append(("D 256", 1, 8, 8, 1024, 1024, 256, True, torch.bfloat16, "plain"))
    for S in (64, 192, 576, 1088, 128, 1000):
        rows.append((f"adversarial rows, S {S}", 1, 4, 4, S, S, 128, False, torch.bfloat16, "adversarial"))
    return rows


def inputs(B, H, H_kv, S_q, S_kv, D, dtype, extra, seed, device="cuda"):
    torch.manual_seed(seed)
    if extra == "bshd":  # the layout transformers hands over: (B, S, H, D) storage seen as (B, H, S, D)
        q, k, v = (torch.randn(B, s, h, D, device=device, dtype=dtype).transpose(1, 2) for s, h in ((S_q, H), (S_kv, H_kv), (S_kv, H_kv)))
    else:
        q, k, v = (torch.randn(B, h, s, D, device=device, dtype=dtype) for s, h in ((S_q, H), (S_kv, H_kv), (S_kv, H_kv)))
    if extra == "adversarial":
        from support.adversarial import anti_align  # noqa: PLC0415 - the tests' helper, on sys.path above

        generator = torch.Generator().manual_seed(seed)
        target = 100.0 + float(torch.tensor(float(S_kv)).log())
        anti_align(q, k, scale=D**-0.5, target=target, rows="all", generator=generator, packed=False)
    mask = torch.randn(B, 1, S_q, S_kv, device=device, dtype=dtype) if extra == "mask" else None
    grad = torch.randn(B, H, S_q, D, device=device, dtype=dtype)
    return q, k, v, mask, grad


def run(backend, q, k, v, mask, grad, *, causal, gqa, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.to(dtype), is_causal=causal, enable_gqa=gqa)
    out.backward(grad.to(dtype))
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def error(result, reference):
    return (result.double() - reference).abs().max().item()


def row(case, seed=0, *, device="cuda", served_by=SDPBackend.CUDNN_ATTENTION):
    """One case's verdicts, or ``{"refused": why}`` when torch does not serve it on ``served_by`` (the tests run the
    check on the CPU with the math backend in cuDNN's place)."""
    label, B, H, H_kv, S_q, S_kv, D, causal, dtype, extra = case
    q, k, v, mask, grad = inputs(B, H, H_kv, S_q, S_kv, D, dtype, extra, seed, device)
    gqa = H != H_kv
    reference = run(SDPBackend.MATH, q, k, v, mask, grad, causal=causal, gqa=gqa, dtype=torch.float64)
    low = run(SDPBackend.MATH, q, k, v, mask, grad, causal=causal, gqa=gqa, dtype=dtype)
    try:
        served = run(served_by, q, k, v, mask, grad, causal=causal, gqa=gqa, dtype=dtype)
    except RuntimeError as failure:
        return {"case": case, "refused": str(failure).splitlines()[0][:120]}
    verdicts = {}
    for name in TENSORS:
        ref = reference[name]
        bound = 2 * error(low[name], ref) + 1e-3 * ref.abs().max().item()
        err = error(served[name], ref)  # a NaN anywhere makes it NaN, an Inf inf: neither is <= bound
        verdicts[name] = (err, bound, err <= bound)
    return {"case": case, "verdicts": verdicts}


def describe(case):
    label, B, H, H_kv, S_q, S_kv, D, causal, dtype, extra = case
    return f"{label} | B {B}, H {H}/{H_kv}, D {D} | {'causal' if causal else 'full'} | {str(dtype).removeprefix('torch.')}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for torch_sdpa_cudnn.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: this checks torch's cuDNN attention on the loaded cuDNN")
    header = (
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()} loaded, {torch.cuda.get_device_name()}; "
        "max |error| against float64 (math backend), bound = 2 x the math backend's error at the same precision + 1e-3 max|ref|"
    )
    lines = [
        "# torch's own cuDNN attention on the loaded cuDNN",
        "",
        header,
        "",
        "| case | shape | mask | dtype | " + " | ".join(f"{n} error / bound" for n in TENSORS) + " | verdict |",
        "|---|---|---|---|" + "---|" * len(TENSORS) + "---|",
    ]
    print(header, flush=True)
    counts = {"pass": 0, "FAIL": 0, "refused": 0}
    for case in cases():
        result = row(case)
        if "refused" in result:
            counts["refused"] += 1
            cells = " | ".join("" for _ in TENSORS)
            line = f"| {describe(case)} | {cells} | not served on cuDNN: {result['refused']} |"
        else:
            ok = all(v[2] for v in result["verdicts"].values())
            counts["pass" if ok else "FAIL"] += 1
            cells = " | ".join(f"{e:.3g} / {b:.3g}" for e, b, _ in result["verdicts"].values())
            line = f"| {describe(case)} | {cells} | {'pass' if ok else 'FAIL'} |"
        lines.append(line)
        print(line, flush=True)
    summary = f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['refused']} not served on cuDNN"
    lines += ["", summary]
    print(summary)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "torch_sdpa_cudnn.md").write_text("\n".join(lines) + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
