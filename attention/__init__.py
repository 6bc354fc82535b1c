"""cuDNN fused attention for PyTorch training: dense and packed, windows, GQA, learnable sinks.

Example:
    >>> import cudnn_attention
    >>> out = cudnn_attention.attention(q, k, v, causal=True)  # (B, H, S, D) bf16 on a GPU
    >>> cudnn_attention.stats()["cudnn_forward"]
    1

Importing this package registers the ``cudnn_attention::forward``/``backward`` ops (with their FLOP formulas for
``torch.utils.flop_counter``, see :mod:`cudnn_attention.flop_formulas`) and, through the transformers integration
(:mod:`cudnn_attention.integrations.hf`, which it imports), puts one hook on
``sys.meta_path`` that makes ``attn_implementation="cudnn"`` available once transformers' modeling code loads
(``cudnn_attention.integrations.hf.unregister()`` removes it). It imports neither transformers nor Lightning (if
transformers' modeling code is loaded already, the name is registered at once instead), and changes nothing
else. The cuDNN frontend is imported on the first GPU call. This module is the only one of the package that
imports an integration: the core modules beside it import none.

Context parallelism (a process group sharding each sequence): :mod:`cudnn_attention.context_parallel`.

FlashAttention-style code swaps one import: :mod:`cudnn_attention.flash_attn_interface` has ``flash_attn_func``,
``flash_attn_varlen_func`` and their packed and KV-cache variants, with FlashAttention's arguments.
"""

from . import context_parallel, flash_attn_interface, flop_formulas
from .api import attention, varlen_attention
from .integrations.hf import load_hook as _hf_load_hook
from .packed_batch import PackedBatch, packed_batch
from .policy import (
    CudnnAttentionCopyWarning,
    CudnnAttentionFallbackWarning,
    StrictModeError,
    flat_stats,
    is_strict,
    reset_stats,
    set_strict,
    stats,
    strict,
)
from .provider import ProviderConflictError, ProviderConflictWarning, ProviderHandle, ProviderUnusedWarning, enabled, install
from .version import __version__ as __version__  # the package face's version (attention/version.py)

__all__ = [
    "CudnnAttentionCopyWarning",
    "CudnnAttentionFallbackWarning",
    "PackedBatch",
    "ProviderConflictError",
    "ProviderConflictWarning",
    "ProviderHandle",
    "ProviderUnusedWarning",
    "StrictModeError",
    "attention",
    "context_parallel",
    "enabled",
    "flash_attn_interface",
    "flat_stats",
    "install",
    "is_strict",
    "packed_batch",
    "reset_stats",
    "set_strict",
    "stats",
    "strict",
    "varlen_attention",
]

# Counters built from now on (Lightning's measure_flops, MFU callbacks) count the ops by the work their masks leave.
flop_formulas.register()

# Last, the one thing importing the package does for transformers: the hook, or "cudnn" registered now when
# transformers' modeling code is already loaded.
_hf_load_hook.install()
