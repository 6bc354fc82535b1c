"""Registering ``"cudnn"`` with transformers, and undoing it.

Both interfaces are needed: transformers gives an implementation whose name has no mask
function ``attention_mask=None`` always, which would silently drop padding.

``import cudnn_attention`` already registers the name once transformers' modeling code loads (a one-shot
hook, :mod:`.load_hook`); :func:`unregister` also takes that hook back.
"""

from __future__ import annotations

import sys

from . import _compat, load_hook
from .attention_function import cudnn_attention_forward
from .mask_function import cudnn_attention_mask

__all__ = ["ATTN_IMPLEMENTATION", "is_registered", "register", "register_when_transformers_loads", "unregister"]

ATTN_IMPLEMENTATION = "cudnn"


def register() -> None:
    """Make ``attn_implementation="cudnn"`` available in transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, cudnn_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, cudnn_attention_mask)


def unregister() -> None:
    """Remove ``"cudnn"`` from both transformers interfaces, and the hook that would register it when
    transformers' modeling code loads (idempotent; imports nothing from transformers)."""
    load_hook.remove()
    if load_hook.TRIGGER not in sys.modules:
        return  # nothing can have been registered yet
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _compat.unregister_interface_entry(AttentionInterface, ATTN_IMPLEMENTATION)
    _compat.unregister_interface_entry(AttentionMaskInterface, ATTN_IMPLEMENTATION)


def is_registered() -> bool:
    """Whether both transformers interfaces know ``"cudnn"`` (loads transformers' modeling code)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return ATTN_IMPLEMENTATION in AttentionInterface() and ATTN_IMPLEMENTATION in AttentionMaskInterface()


def register_when_transformers_loads() -> None:
    """Register now if transformers' modeling code is loaded, else as soon as it is (what ``import cudnn_attention`` does)."""
    load_hook.install()
