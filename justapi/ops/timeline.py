"""Per-step event times of one process: a bounded in-memory ring, dumped as JSON at exit.

Off unless `JUSTAPI_TIMELINE=DIR` is set in `justapi serve`'s environment (its children
inherit it): then the frontend, the scheduler and every worker record `(monotonic ns, event,
step id, count)` at the points of a step (docs/runtime.md, "Where a served step's time goes") and
write `DIR/<role><index>-<pid>.json` when they stop. CLOCK_MONOTONIC is one clock for every
process of a host, so `python -m tools.bench timeline` lines the three files up.
Owns: the ring and its file. Does not own: the events' meaning (the processes that mark them).
"""
from __future__ import annotations

import json
import os
import time
from collections import deque

TIMELINE_ENV = "JUSTAPI_TIMELINE"
DEFAULT_CAPACITY = 1 << 18
"""Events kept per process (the newest): about 30,000 steps of a worker."""

Event = tuple[int, str, int, int]  # (monotonic ns, event name, step id or -1, count)


class Timeline:
    """`mark(event, step_id, count)` appends to the ring; a disabled timeline's mark does nothing."""

    def __init__(self, role: str, index: int = 0, directory: str = "",
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.role = role
        self.index = index
        self.directory = directory
        self.events: deque[Event] = deque(maxlen=capacity)
        self.is_enabled = bool(directory)

    @classmethod
    def from_env(cls, role: str, index: int = 0) -> Timeline:
        return cls(role, index, os.environ.get(TIMELINE_ENV, ""))

    def mark(self, event: str, step_id: int = -1, count: int = 0) -> None:
        if self.is_enabled:
            self.events.append((time.monotonic_ns(), event, step_id, count))

    def mark_cpu(self, step_id: int = -1) -> None:
        """The event "cpu" with this process's CPU time so far (ns, all threads) as its count:
        two of them give the CPU a stretch of steps cost, whatever else ran on the host."""
        if self.is_enabled:
            self.events.append((time.monotonic_ns(), "cpu", step_id, time.process_time_ns()))

    def dump(self) -> str | None:
        """Write the ring to DIR/<role><index>-<pid>.json; the path, or None when disabled."""
        if not self.is_enabled:
            return None
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{self.role}{self.index}-{os.getpid()}.json")
        with open(path, "w") as handle:
            json.dump({"role": self.role, "index": self.index, "pid": os.getpid(),
                       "events": list(self.events)}, handle)
        return path


def load(path: str) -> tuple[str, int, list[Event]]:
    """(role, index, events) of a dumped file."""
    with open(path) as handle:
        data = json.load(handle)
    return str(data["role"]), int(data["index"]), [tuple(e) for e in data["events"]]  # type: ignore[misc]
