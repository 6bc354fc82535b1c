"""What ``import cudnn_attention`` does for transformers: ``attn_implementation="cudnn"`` once its modeling code loads.

:func:`install` puts one :class:`RegisterOnLoad` on ``sys.meta_path`` and imports nothing: the core never
imports transformers or ``cudnn_attention.integrations``. When ``transformers.modeling_utils`` is imported (it
defines the attention interfaces), the hook lets it load, leaves ``sys.meta_path``, and calls the transformers
integration's ``register`` by module name. ``cudnn_attention.integrations.hf.unregister()`` calls :func:`remove`,
so the hook can be taken back before it fires.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["TRIGGER", "RegisterOnLoad", "install", "pending", "remove"]

TRIGGER = "transformers.modeling_utils"
# Named, not imported: the integration imports the core, never the reverse.
_REGISTRATION = "cudnn_attention.integrations.hf.registration"


def _register() -> None:
    importlib.import_module(_REGISTRATION).register()


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
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Register now if transformers' modeling code is loaded, else install the hook (idempotent)."""
    if TRIGGER in sys.modules:
        _register()
    elif not pending():
        sys.meta_path.insert(0, RegisterOnLoad())


def pending() -> bool:
    """Whether the hook waits on ``sys.meta_path``."""
    return any(isinstance(finder, RegisterOnLoad) for finder in sys.meta_path)


def remove() -> None:
    """Take the hook off ``sys.meta_path`` (idempotent)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, RegisterOnLoad)]
