"""A scheduler total read from its snapshots, kept monotonic across a scheduler restart.

Owns: that arithmetic. Does not own: the metrics that use it (metrics.py, failure_metrics.py).
"""
from __future__ import annotations


class MonotonicTotal:
    """A scheduler total that restarts at 0 when the scheduler does -> a monotonic counter."""

    def __init__(self) -> None:
        self._base = 0.0
        self._last = 0.0

    def update(self, value: float) -> float:
        if value < self._last:  # the source restarted: keep what was counted before
            self._base += self._last
        self._last = value
        return self._base + value
