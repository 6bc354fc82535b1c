"""The "trainer flag": ``callbacks_factory`` entry points that add ``CudnnAttention`` when ``CUDNN_ATTENTION=1``.

Lightning calls every function registered in the entry-point group
``lightning.pytorch.callbacks_factory`` (``pytorch_lightning.callbacks_factory``) for EVERY Trainer
it builds, so these add nothing unless the user opts in with the environment variable, e.g. for a
training script they cannot edit::

    CUDNN_ATTENTION=1 python train.py            # also CUDNN_ATTENTION_STRICT=1 for strict mode

This module imports neither Lightning namespace at import time: a ``pytorch_lightning``-only
environment loads it too.
"""

from __future__ import annotations

from ...policy import env_flag

__all__ = ["ENV_VAR", "callbacks", "pytorch_lightning_callbacks", "requested"]

ENV_VAR = "CUDNN_ATTENTION"


def requested() -> bool:
    """Whether ``CUDNN_ATTENTION`` asks for the callback (``1``, ``true``, ``yes`` or ``on``)."""
    return env_flag(ENV_VAR)


def callbacks() -> list:
    """Entry point of ``lightning.pytorch.callbacks_factory``: ``[CudnnAttention()]`` if requested, else ``[]``."""
    if not requested():
        return []
    from .callback import CudnnAttention

    return [CudnnAttention()]


def pytorch_lightning_callbacks() -> list:
    """Entry point of ``pytorch_lightning.callbacks_factory``: the ``pytorch_lightning`` twin of :func:`callbacks`."""
    if not requested():
        return []
    from .pytorch_lightning import CudnnAttention

    return [CudnnAttention()]
