"""``CudnnAttention`` for ``lightning.pytorch`` (``import lightning``); the ``pytorch_lightning`` twin lives in
:mod:`cudnn_attention.integrations.lightning.pytorch_lightning` (the two namespaces must not mix)."""

from __future__ import annotations

from lightning.pytorch import Callback

from ._switch import CudnnAttentionHooks

__all__ = ["CudnnAttention"]


class CudnnAttention(CudnnAttentionHooks, Callback):
    """Run attention on cuDNN for a ``lightning.pytorch`` Trainer, and undo it afterwards.

    In ``setup`` (every rank, before wrapping/compilation) it installs the provider, so
    ``F.scaled_dot_product_attention`` on the cuDNN backend runs on this project's ops; at each
    fit/validate/test/predict start it switches every Hugging Face model in the LightningModule
    to ``attn_implementation="cudnn"``; ``teardown`` and ``on_exception`` give everything back.
    Also a Fabric callback (``on_after_setup``). Picklable (``ddp_spawn``).

    Args:
        strict: make every fallback from cuDNN raise while the trainer runs.
        provider: install the ``F.scaled_dot_product_attention``/``varlen_attn`` provider.
        hf_models: switch Hugging Face models to ``"cudnn"`` (and back).
        log_stats: log served/fallback counts to the trainer's loggers at each training epoch end.

    Example:
        >>> trainer = Trainer(callbacks=[CudnnAttention(strict=True)])
        >>> # LightningCLI: --trainer.callbacks+=cudnn_attention.integrations.lightning.CudnnAttention
        >>> # unedited scripts: CUDNN_ATTENTION=1 python train.py  (entry point, see factory.py)
    """
