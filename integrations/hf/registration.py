"""Registering ``"cudnn"`` with transformers, and undoing it.

Both interfaces are needed: transformers gives an implementation whose name has no mask
function ``attention_mask=None`` always, which would silently drop padding.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from .attention_function import cudnn_attention_forward
from .mask_function import cudnn_attention_mask

__all__ = ["ATTN_IMPLEMENTATION", "is_registered", "register", "register_when_transformers_loads", "unregister"]

ATTN_IMPLEMENTATION = "cudnn"
_TRIGGER = "transformers.modeling_utils"


def register() -> None:
    """Make ``attn_implementation="cudnn"`` available in transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, cudnn_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, cudnn_attention_mask)


def unregister() -> None:
    """Remove the ``"cudnn"`` name from both transformers interfaces (idempotent)."""
    if _TRIGGER not in sys.modules:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)
    AttentionMaskInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)


def is_registered() -> bool:
    """Whether both transformers interfaces know ``"cudnn"`` (loads transformers' modeling code)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return ATTN_IMPLEMENTATION in AttentionInterface._global_mapping and ATTN_IMPLEMENTATION in AttentionMaskInterface._global_mapping


class _RegisterAfterLoad(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``transformers.modeling_utils`` so the name is registered right after
    transformers defines its interfaces: ``import cudnn_attention`` never imports transformers."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register()

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_transformers_loads() -> None:
    """Register now if transformers' modeling code is loaded, else as soon as it is."""
    if _TRIGGER in sys.modules:
        register()
    elif not any(isinstance(finder, _RegisterAfterLoad) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLoad())
