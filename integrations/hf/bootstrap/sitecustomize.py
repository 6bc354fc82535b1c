"""Start-up hook of every Python process that ``cudnn-attention run`` starts (this directory is first on PYTHONPATH).

As if the program began with ``import cudnn_attention``: right after transformers' modeling code loads,
``cudnn_attention`` is imported, which registers ``attn_implementation="cudnn"``. Nothing is imported at
start-up (no torch, no transformers, no cudnn_attention), and a process that never loads transformers'
modeling code imports nothing at all. The ``sitecustomize`` this one shadows, if any, still runs.

The hook has the shape of ``cudnn_attention.integrations.hf.load_hook.RegisterOnLoad`` but cannot be it: importing
that module imports torch (through its package).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_TRIGGER = "transformers.modeling_utils"


class _ImportCudnnAttentionAfterLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the search below from finding this hook again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_import(module):
            exec_module(module)
            # With transformers' modeling code loaded, the import registers "cudnn" at once (a no-op when
            # the program imported cudnn_attention itself, or unregistered it since).
            importlib.import_module("cudnn_attention")

        spec.loader.exec_module = exec_then_import
        return spec


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


sys.meta_path.insert(0, _ImportCudnnAttentionAfterLoad())
_run_shadowed_sitecustomize()
