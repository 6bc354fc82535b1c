"""Every touch of a private Lightning API, in one place (the core's :mod:`cudnn_attention._compat` holds torch's
and the cuDNN frontend's).

Each function names the private attribute it reaches, the versions it was checked against, and what replaces it
when it moves. Nothing here imports Lightning: each takes the object to act on as an argument.
"""

from __future__ import annotations

__all__ = ["monitor_throughputs"]


def monitor_throughputs(monitor) -> list:
    """The ``Throughput`` objects a ``ThroughputMonitor`` built in its ``setup`` (one per running stage).

    ``ThroughputMonitor._throughputs``: checked against lightning 2.6 (and its ``pytorch_lightning`` twin). When
    it moves, a monitor subclass builds them itself in ``setup`` (Lightning's own is eight lines) with the peak."""
    return list(monitor._throughputs.values())
