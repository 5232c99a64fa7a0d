"""Restarts: what the launcher does about a worker or the scheduler process that exited.

A worker: the scheduler has already fenced it and re-queued its requests (it sees the exit
within 2 s on its own). Without `restart-workers` the launcher logs the exit once and the
slot stays down. With it, a replacement with the same index is started; it maps the same
CPU pool (or allocates its GPU pool again) and rejoins the scheduler with its Ready. A slot
restarted `max-restarts` times within `restart-window-s` stays down: a crash loop would
otherwise spend the machine on start-ups.
A scheduler that died (SchedulerSupervisor, restart-scheduler, on by default) is started
again under the same limits; its workers and the frontend wait for it (justapi/scheduler/
process.py, justapi/frontend/lifecycle.py).
Owns: restart decisions and their history. Does not own: spawning (launcher.py).
"""
from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from justapi.config.ops import OpsConfig

logger = logging.getLogger(__name__)


class ChildLike(Protocol):
    """What the supervisor reads of the launcher's Child."""

    role: str
    index: int
    process: Any  # subprocess.Popen


class WorkerSupervisor:
    def __init__(self, config: OpsConfig, respawn: Callable[[ChildLike], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._respawn = respawn
        self._clock = clock
        self._restarts: dict[int, deque[float]] = {}
        self._reported: set[int] = set()  # pids whose exit was already handled
        self.num_restarts = 0

    def check(self, children: Sequence[ChildLike]) -> None:
        """Handle every worker in `children` whose process has exited (each once)."""
        for child in list(children):
            if child.role != "worker" or child.process.pid in self._reported:
                continue
            code = child.process.poll()
            if code is None:
                continue
            self._reported.add(child.process.pid)
            self._on_exit(child, code)

    def _on_exit(self, child: ChildLike, code: int) -> None:
        what = f"worker {child.index} (pid {child.process.pid}) exited with {describe_exit(code)}"
        allowed, why = self.may_restart(child.index)
        if not allowed:
            logger.error("%s; not restarted: %s", what, why)
            return
        logger.warning("%s; starting a replacement (%s)", what, why)
        self._restarts.setdefault(child.index, deque()).append(self._clock())
        self.num_restarts += 1
        self._respawn(child)

    def may_restart(self, index: int) -> tuple[bool, str]:
        """Whether slot `index` may be restarted now, and why (for the log line)."""
        if not self.config.restart_workers:
            return False, "restart-workers is off"
        return window_allows(self._restarts.setdefault(index, deque()), self.config,
                             self._clock())


class SchedulerSupervisor:
    """What the launcher does about a scheduler that exited on its own (a crash, a signal):
    with restart-scheduler, start a new one - the workers keep running and the frontend holds
    every open request for it - at most max-restarts times within restart-window-s. An exit
    with code 0 is a scheduler that was told to stop (it stopped its workers): never restarted."""

    def __init__(self, config: OpsConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._history: deque[float] = deque()
        self.num_restarts = 0

    def on_exit(self, pid: int, code: int) -> bool:
        """Log the exit; True when a new scheduler is to be started."""
        what = f"the scheduler (pid {pid}) exited with {describe_exit(code)}"
        if not self.config.restart_scheduler or code == 0:
            return False  # the caller stops the pool with its own line
        allowed, why = window_allows(self._history, self.config, self._clock())
        if not allowed:
            logger.error("%s; not restarted: %s", what, why)
            return False
        logger.warning("%s; starting a new one, the frontend holds the open requests (%s)",
                       what, why)
        self._history.append(self._clock())
        self.num_restarts += 1
        return True


def window_allows(history: deque[float], config: OpsConfig, now: float) -> tuple[bool, str]:
    """Whether one more restart fits max-restarts within restart-window-s (history: the
    times of the earlier restarts, pruned here), and why (for the log line)."""
    while history and now - history[0] > config.restart_window_s:
        history.popleft()
    if len(history) >= config.max_restarts:
        return False, (f"{len(history)} restart(s) in the last {config.restart_window_s:.0f}s "
                       f"(max-restarts {config.max_restarts})")
    return True, (f"restart {len(history) + 1} of at most {config.max_restarts} in "
                  f"{config.restart_window_s:.0f}s")


def describe_exit(code: int) -> str:
    """Popen's returncode in words: 'code 1', or 'signal SIGKILL' for a negative code."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"
