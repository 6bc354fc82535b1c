"""Whether context parallelism is on: the one predicate the public entry points read on every call.

``active`` is the :class:`~cudnn_attention.context_parallel.ContextParallel` whose block the program is in, or None (the
default; also while that layer makes its own per-rank calls). It lives in this module of its own, which imports
nothing, so that :mod:`cudnn_attention.api` can read it without importing the context-parallel layer, which imports
the API. Only :mod:`cudnn_attention.context_parallel` writes it.
"""

from __future__ import annotations

__all__ = ["active"]

active = None
