"""Start-up hook: ``attn_implementation="cudnn"`` in programs that never ``import cudnn_attention``.

Installed as a top-level module beside ``cudnn_attention_autoload.pth`` in site-packages, whose one line Python's
``site`` runs at every start-up (not under ``python -S`` or ``-I``): :func:`install_unless_disabled`. That puts one
:class:`ImportCudnnAttentionAfterLoad` on ``sys.meta_path`` and imports nothing (no torch, no transformers, no
cudnn_attention; this module imports ``os`` and ``sys`` only, which start-up has loaded already). A process that never
imports transformers' modeling code imports nothing more; one that does imports ``cudnn_attention`` right after it,
as if the program began with ``import cudnn_attention``: that registers ``"cudnn"`` (and, when the program imported
cudnn_attention itself, is a no-op). So ``attn_implementation="cudnn"`` works as ``"flash_attention_2"`` does,
with no import. ``CUDNN_ATTENTION_NO_AUTOLOAD=1`` turns it off; ``cudnn-attention run`` installs it regardless.
"""

import os
import sys

__all__ = ["DISABLE_VARIABLE", "TRIGGER", "ImportCudnnAttentionAfterLoad", "disabled", "install", "install_unless_disabled"]

TRIGGER = "transformers.modeling_utils"
DISABLE_VARIABLE = "CUDNN_ATTENTION_NO_AUTOLOAD"


class ImportCudnnAttentionAfterLoad:
    """A ``sys.meta_path`` finder that answers only for ``transformers.modeling_utils``: it lets that module load,
    leaves ``sys.meta_path``, then imports ``cudnn_attention``. (Not an ``importlib.abc.MetaPathFinder``
    subclass: importing ``importlib.abc`` would cost every process that start-up time.)"""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER:
            return None
        import importlib
        import importlib.util

        _remove()  # one shot; also keeps the search below from finding this hook again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_import(module):
            exec_module(module)
            # With transformers' modeling code loaded, the package registers "cudnn" as it is imported.
            importlib.import_module("cudnn_attention")

        spec.loader.exec_module = exec_then_import
        return spec


def disabled() -> bool:
    """Whether ``CUDNN_ATTENTION_NO_AUTOLOAD`` is ``1``, ``true``, ``yes`` or ``on`` (any case)."""
    return os.environ.get(DISABLE_VARIABLE, "0").strip().lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Put the hook on ``sys.meta_path`` (idempotent); import ``cudnn_attention`` now if transformers' modeling code
    is loaded already."""
    if TRIGGER in sys.modules:
        __import__("cudnn_attention")
    elif not any(isinstance(finder, ImportCudnnAttentionAfterLoad) for finder in sys.meta_path):
        sys.meta_path.insert(0, ImportCudnnAttentionAfterLoad())


def install_unless_disabled() -> None:
    """What ``cudnn_attention_autoload.pth`` runs at start-up: :func:`install`, unless :func:`disabled`."""
    if not disabled():
        install()


def _remove() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, ImportCudnnAttentionAfterLoad)]
