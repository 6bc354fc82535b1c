"""cuDNN fused attention for PyTorch training: dense and packed, windows, GQA, learnable sinks.

Example:
    >>> import cudnn_attention
    >>> out = cudnn_attention.attention(q, k, v, causal=True)  # (B, H, S, D) bf16 on a GPU
    >>> cudnn_attention.stats()["cudnn_forward"]
    1

Importing this package registers the ``cudnn_attention::forward``/``backward`` ops and changes
nothing else; the cuDNN frontend is imported on the first GPU call.
"""

from .api import attention, varlen_attention
from .policy import CudnnAttentionFallbackWarning, StrictModeError, is_strict, reset_stats, set_strict, stats, strict
from .provider import ProviderHandle, enabled, install

__version__ = "0.1.0"

__all__ = [
    "CudnnAttentionFallbackWarning",
    "ProviderHandle",
    "StrictModeError",
    "attention",
    "enabled",
    "install",
    "is_strict",
    "reset_stats",
    "set_strict",
    "stats",
    "strict",
    "varlen_attention",
]

# transformers: make attn_implementation="cudnn" available once its modeling code loads. This
# only adds a name there, and imports nothing from transformers now.
from .integrations.hf.registration import register_when_transformers_loads as _register_with_transformers  # noqa: E402

_register_with_transformers()
