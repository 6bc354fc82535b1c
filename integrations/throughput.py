"""The dense bf16 tensor-core peak of the current GPU, for model-FLOPs utilization (MFU).

For the integrations and recipes that report MFU (the Lightning callbacks, the Trainer recipes); not
part of the attention core.

Lightning's ``get_available_flops`` finds no entry for an H200 SXM (its device name is just
"NVIDIA H200", while the table expects "sxm1"/"nvl1" in the name) and lists H200 figures with
2:4 sparsity, twice the dense peak a training step can reach. This table holds dense figures only.

Sources: NVIDIA's datasheets list "BFLOAT16 Tensor Core" throughput *with sparsity*; the dense
peak is half of it.

- H200 datasheet (nvidia.com/en-us/data-center/h200): H200 SXM 1,979 TFLOPS -> 989.4e12 dense;
  H200 NVL 1,671 TFLOPS -> 835.5e12. GH200's GPU has the SXM part's tensor-core peak.
- H100 datasheet (nvidia.com/en-us/data-center/h100): H100 SXM 1,979 -> 989.4e12; H100 NVL 1,671
  -> 835.5e12; H100 PCIe 1,513 -> 756.5e12.
- A100 datasheet (nvidia.com/en-us/data-center/a100): 624 -> 312e12, SXM and PCIe alike.

float16 has the same peak as bfloat16 on all of these. Pass ``override=`` for anything else
(clock-limited parts, newer GPUs), or to use a measured peak instead.
"""

from __future__ import annotations

import torch

__all__ = ["DENSE_BF16_PEAK_FLOPS", "dense_bf16_peak_flops", "lookup_dense_bf16_peak_flops"]

# (substrings that must all appear in the lower-cased device name, dense bf16 FLOP/s), most
# specific first: "NVIDIA H200 NVL" must not match the plain H200 (SXM) row.
DENSE_BF16_PEAK_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h200", "nvl"), 835.5e12),
    (("h200",), 989.4e12),  # "NVIDIA H200" (SXM), "NVIDIA GH200 480GB"
    (("h100", "nvl"), 835.5e12),
    (("h100", "pcie"), 756.5e12),
    (("h100",), 989.4e12),  # "NVIDIA H100 80GB HBM3" (SXM)
    (("a100",), 312e12),
)


def lookup_dense_bf16_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a CUDA device name (``torch.cuda.get_device_name()``), or ``None`` if unknown."""
    name = device_name.lower()
    for parts, flops in DENSE_BF16_PEAK_FLOPS:
        if all(part in name for part in parts):
            return flops
    return None


def dense_bf16_peak_flops(device: torch.device | str | int | None = None, *, override: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` (default: the current CUDA device), or ``None``.

    Args:
        device: a CUDA device; a non-CUDA device has no entry (``None``).
        override: returned as is when given (a part missing from the table, or a measured peak).

    Example:
        >>> dense_bf16_peak_flops()  # on an H200 SXM
        989400000000000.0
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"override must be a positive FLOP/s figure, got {override}")
        return float(override)
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return None
    return lookup_dense_bf16_peak_flops(torch.cuda.get_device_name(device))
