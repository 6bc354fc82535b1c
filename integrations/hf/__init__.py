"""transformers integration: ``attn_implementation="cudnn"``.

``import cudnn_attention`` makes the name available as soon as transformers' modeling code loads
(without importing transformers itself); :func:`register` does it explicitly.

Example:
    >>> import cudnn_attention
    >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cudnn", dtype=torch.bfloat16)
    >>> model.set_attn_implementation("eager")  # and back: model.set_attn_implementation("cudnn")
"""

from .attention_function import cudnn_attention_forward
from .mask_function import cudnn_attention_mask
from .registration import ATTN_IMPLEMENTATION, is_registered, register, register_when_transformers_loads, unregister

__all__ = [
    "ATTN_IMPLEMENTATION",
    "cudnn_attention_forward",
    "cudnn_attention_mask",
    "is_registered",
    "register",
    "register_when_transformers_loads",
    "unregister",
]
