"""cuDNN fused attention for PyTorch training: dense and packed, windows, GQA, learnable sinks.

Example:
    >>> import cudnn_attention
    >>> out = cudnn_attention.attention(q, k, v, causal=True)  # (B, H, S, D) bf16 on a GPU
    >>> cudnn_attention.stats()["cudnn_forward"]
    1

Importing this package registers the ``cudnn_attention::forward``/``backward`` ops (with their FLOP formulas for
``torch.utils.flop_counter``, see :mod:`cudnn_attention.flop_formulas`) and puts one hook on
``sys.meta_path`` that makes ``attn_implementation="cudnn"`` available once transformers' modeling code loads
(``cudnn_attention.integrations.hf.unregister()`` removes it); it imports neither transformers nor the
integrations (if transformers' modeling code is loaded already, the name is registered at once instead), and
changes nothing else. The cuDNN frontend is imported on the first GPU call.

FlashAttention-style code swaps one import: :mod:`cudnn_attention.flash_attn_interface` has ``flash_attn_func``,
``flash_attn_varlen_func`` and their packed and KV-cache variants, with FlashAttention's arguments.
"""

from . import _transformers_hook, flash_attn_interface, flop_formulas
from .api import attention, varlen_attention
from .policy import CudnnAttentionFallbackWarning, StrictModeError, flat_stats, is_strict, reset_stats, set_strict, stats, strict
from .provider import ProviderConflictError, ProviderConflictWarning, ProviderHandle, enabled, install

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (dynamic version)

__all__ = [
    "CudnnAttentionFallbackWarning",
    "ProviderConflictError",
    "ProviderConflictWarning",
    "ProviderHandle",
    "StrictModeError",
    "attention",
    "enabled",
    "flash_attn_interface",
    "flat_stats",
    "install",
    "is_strict",
    "reset_stats",
    "set_strict",
    "stats",
    "strict",
    "varlen_attention",
]

# Counters built from now on (Lightning's measure_flops, MFU callbacks) count the ops by the work their masks leave.
flop_formulas.register()

# Last, once every name above is bound: when transformers' modeling code is already loaded, this registers
# "cudnn" now, through the integration, which imports this package.
_transformers_hook.install()
