"""Training recipes on cuDNN attention, importable as ``cudnn_attention.recipes``.

Run them as scripts (``python3 recipes/train_sliding_window.py``); their shared pieces live in
:mod:`cudnn_attention.recipes.common`, which tests and benchmarks import like any other module.
Importing this package imports nothing else.
"""

__all__: list[str] = []
