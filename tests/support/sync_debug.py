"""Running GPU code with ``torch.cuda.set_sync_debug_mode("error")``, so a device-to-host sync raises."""

from __future__ import annotations

import torch

__all__ = ["warm_and_run"]


def warm_and_run(fn):
    """``fn()`` once to build its graphs (a one-time host cost that may synchronize), then again with any
    device-to-host synchronization raising; returns the second result."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
