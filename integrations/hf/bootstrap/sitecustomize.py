"""Start-up hook of every Python process that ``cudnn-attention run`` starts (this directory is first on PYTHONPATH).

As if the program began with ``import cudnn_attention``: right after transformers' modeling code loads,
``cudnn_attention`` is imported, which registers ``attn_implementation="cudnn"``. This is the hook that
``cudnn_attention_autoload.pth`` installs at start-up where the package is installed
(:mod:`cudnn_attention_autoload`, beside this file), here installed even where ``CUDNN_ATTENTION_NO_AUTOLOAD=1``:
the command was run through the launcher to have it. Nothing is imported at start-up (no torch, no transformers, no
cudnn_attention), and a process that never loads transformers' modeling code imports nothing at all. The
``sitecustomize`` this one shadows, if any, still runs.
"""

import importlib.machinery
import importlib.util
import os
import sys

import cudnn_attention_autoload


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


cudnn_attention_autoload.install()
_run_shadowed_sitecustomize()
