"""transformers integration: ``attn_implementation="cudnn"``.

``import cudnn_attention`` makes the name available as soon as transformers' modeling code loads
(without importing transformers itself); :func:`register` does it explicitly, :func:`unregister` undoes
both. :func:`switch_to_cudnn` moves the models inside any module to ``"cudnn"`` and gives them back.
``cudnn-attention run -- <command>`` makes the name available in a command you do not edit (:mod:`.launch`).
:func:`shard_batch_for_context_parallel` cuts a batch for a context-parallel forward (:mod:`.context_parallel`).

Example:
    >>> import cudnn_attention
    >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cudnn", dtype=torch.bfloat16)
    >>> model.set_attn_implementation("eager")  # and back: model.set_attn_implementation("cudnn")
    >>> with switch_to_cudnn(model):  # a model built elsewhere: "cudnn" inside, its own implementation after
    ...     trainer.train()
"""

from .attention_function import cudnn_attention_forward
from .context_parallel import shard_batch_for_context_parallel
from .mask_function import cudnn_attention_mask
from .model_switch import ModelSwitch, switch_to_cudnn
from .registration import ATTN_IMPLEMENTATION, is_registered, register, register_when_transformers_loads, unregister

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ModelSwitch",
    "cudnn_attention_forward",
    "cudnn_attention_mask",
    "is_registered",
    "register",
    "register_when_transformers_loads",
    "shard_batch_for_context_parallel",
    "switch_to_cudnn",
    "unregister",
]
