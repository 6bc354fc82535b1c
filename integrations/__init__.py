"""Framework integrations built on the :mod:`cudnn_attention` core, which imports none of them.

- :mod:`.hf`: transformers' ``attn_implementation="cudnn"``, the model switch, and ``cudnn-attention run``;
- :mod:`.lightning`: the ``CudnnAttention`` callback, Fabric, and MFU in Lightning's throughput monitor;
- :mod:`.throughput`: the dense bf16 peak FLOP/s of NVIDIA data-center GPUs, for MFU (the Lightning
  integration and the recipes report it).
"""
