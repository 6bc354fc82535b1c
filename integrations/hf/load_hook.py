"""What ``import cudnn_attention`` installs for transformers: ``attn_implementation="cudnn"`` once its modeling code loads.

:func:`install` puts one :class:`RegisterOnLoad` on ``sys.meta_path`` and imports nothing from transformers. When
``transformers.modeling_utils`` is imported (it defines the attention interfaces), the hook lets it load, leaves
``sys.meta_path``, and calls :func:`.registration.register`. :func:`.registration.unregister` calls :func:`remove`,
so the hook can be taken back before it fires. The package face (``cudnn_attention/__init__.py``) imports this
module openly; the core imports no integration.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from . import registration  # a cycle (registration imports this module): both only look each other up when called

__all__ = ["TRIGGER", "RegisterOnLoad", "install", "pending", "remove"]

TRIGGER = "transformers.modeling_utils"


class RegisterOnLoad(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``transformers.modeling_utils`` so that ``"cudnn"`` is registered right after it runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TRIGGER:
            return None
        remove()  # one shot; also keeps the search below from finding this hook again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            registration.register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Register now if transformers' modeling code is loaded, else install the hook (idempotent)."""
    if TRIGGER in sys.modules:
        registration.register()
    elif not pending():
        sys.meta_path.insert(0, RegisterOnLoad())


def pending() -> bool:
    """Whether the hook waits on ``sys.meta_path``."""
    return any(isinstance(finder, RegisterOnLoad) for finder in sys.meta_path)


def remove() -> None:
    """Take the hook off ``sys.meta_path`` (idempotent)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, RegisterOnLoad)]
