"""Worker health table kept by the scheduler process: heartbeats, steps in flight, verdicts.

Workers send a Heartbeat every HEARTBEAT_INTERVAL_S (justapi/wire/ids.py); one silent for
the heartbeat timeout is unhealthy (so a dead or stopped worker is caught within 2 s), as is
one whose step has been in flight longer than the step timeout while it still beats (a hung
step), and one with a fatal report (its process exited, it became unreachable, its GPU
failed: the caller says why). Pure logic with times passed in, testable without processes.
Owns: the health table and the wording of its verdicts. Does not own: reading NVML or
/proc (watch.py), what happens to an unhealthy worker's requests (scheduler core).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from justapi.wire.protocol import Heartbeat

HEARTBEAT_TIMEOUT_S = 1.5
STEP_TIMEOUT_S = 120.0


@dataclass
class WorkerHealth:
    worker_id: int
    pool_id: int
    last_heartbeat_s: float
    last_progress_s: float
    is_healthy: bool = True
    reason: str = ""
    rss_bytes: int = 0
    cpu_time_s: float = 0.0
    gpu: dict = field(default_factory=dict)
    """The worker's own GPU figures (torch allocator) merged with the scheduler's NVML reading."""
    pid: int = 0
    device: str = "cpu"
    pool: dict = field(default_factory=dict)
    """The KV pool's state as the worker last reported it."""
    step_id: int = -1
    step_sent_s: float | None = None
    """When the oldest step in flight could start (sent, or the step before it came back);
    None when the worker is idle."""
    later_step_ids: list[int] = field(default_factory=list)
    """Steps sent after step_id, still in flight (overlap: the next one is sent early)."""
    fatal: str = ""
    """A fatal condition reported since the last verdict (turned unhealthy by newly_unhealthy)."""
    num_restarts: int = 0

    def as_dict(self, now_s: float) -> dict[str, Any]:
        """One row of the table: flat values (numbers are exported as gauges on /metrics)."""
        row: dict[str, Any] = {
            "worker_id": self.worker_id, "pool_id": self.pool_id, "pid": self.pid,
            "device": self.device, "healthy": self.is_healthy, "reason": self.reason,
            "heartbeat_age_s": round(max(0.0, now_s - self.last_heartbeat_s), 3),
            "step_age_s": (round(now_s - self.step_sent_s, 3)
                           if self.step_sent_s is not None else 0.0),
            "rss_bytes": self.rss_bytes, "cpu_time_s": round(self.cpu_time_s, 3),
            "num_restarts": self.num_restarts, "pool": dict(self.pool),
        }
        row.update({f"gpu_{key}": value for key, value in self.gpu.items()})
        return row


class HealthMonitor:
    def __init__(self, timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 step_timeout_s: float = STEP_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.workers: dict[int, WorkerHealth] = {}

    # ------------------------------------------------------------------ events
    def add_worker(self, worker_id: int, pool_id: int, now_s: float | None = None, *,
                   pid: int = 0, device: str = "cpu") -> None:
        """A worker (re)joined with its Ready: a fresh, healthy row (restarts are counted)."""
        now = _now(now_s)
        previous = self.workers.get(worker_id)
        self.workers[worker_id] = WorkerHealth(
            worker_id, pool_id, now, now, pid=pid, device=device,
            num_restarts=previous.num_restarts + 1 if previous is not None else 0)

    def on_heartbeat(self, beat: Heartbeat, now_s: float | None = None) -> None:
        worker = self.workers.get(beat.worker_id)
        if worker is None:
            return
        worker.last_heartbeat_s = _now(now_s)
        worker.rss_bytes, worker.cpu_time_s = beat.rss_bytes, beat.cpu_time_s
        worker.pool = dict(beat.pool) if isinstance(beat.pool, dict) else {}
        own = dict(beat.gpu) if isinstance(beat.gpu, dict) else {}
        fatal = own.pop("fatal", None)
        worker.gpu.update(own)
        if fatal:
            self.report_fatal(beat.worker_id, str(fatal))

    def on_gpu_reading(self, worker_id: int, figures: dict[str, Any]) -> None:
        """The scheduler's NVML reading of the worker's GPU (names as GpuReading.as_dict)."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.gpu.update(figures)

    def on_step_sent(self, worker_id: int, step_id: int, now_s: float | None = None) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        if worker.step_sent_s is None:
            worker.step_id, worker.step_sent_s = step_id, _now(now_s)
        else:  # queued behind the step in flight: its time starts when that one is back
            worker.later_step_ids.append(step_id)

    def on_progress(self, worker_id: int, now_s: float | None = None) -> None:
        """A step result came back: the worker is making progress, and idle unless a step
        was queued behind it (that one starts now)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        worker.last_progress_s = _now(now_s)
        if worker.later_step_ids:
            worker.step_id, worker.step_sent_s = worker.later_step_ids.pop(0), _now(now_s)
        else:
            worker.step_sent_s = None

    def report_fatal(self, worker_id: int, reason: str) -> None:
        """A condition that makes the worker unhealthy at the next verdict (first one wins)."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.is_healthy and not worker.fatal:
            worker.fatal = reason

    def mark_unhealthy(self, worker_id: int, reason: str) -> None:
        """Unhealthy now (the caller retires the worker itself; newly_unhealthy skips it)."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.is_healthy:
            worker.is_healthy, worker.reason = False, reason

    # ------------------------------------------------------------------ verdicts
    def newly_unhealthy(self, now_s: float) -> list[tuple[int, str]]:
        """Workers that just crossed into unhealthy, with why; each reported once."""
        out = []
        for worker in self.workers.values():
            if not worker.is_healthy:
                continue
            reason = worker.fatal or self._timeout_reason(worker, now_s)
            if reason:
                worker.is_healthy = False
                worker.reason = reason
                out.append((worker.worker_id, reason))
        return out

    def _timeout_reason(self, worker: WorkerHealth, now_s: float) -> str:
        silent_s = now_s - worker.last_heartbeat_s
        if silent_s > self.timeout_s:
            return f"no heartbeat for {silent_s:.1f}s"
        if worker.step_sent_s is not None and now_s - worker.step_sent_s > self.step_timeout_s:
            return (f"step {worker.step_id} in flight for {now_s - worker.step_sent_s:.0f}s "
                    "(hung; its heartbeat still beats)")
        return ""

    def problems(self, pool_ids: list[int]) -> list[str]:
        """What makes the server unhealthy: a pool without a healthy worker."""
        return [f"pool {pool_id} has no healthy worker" for pool_id in pool_ids
                if not self.healthy_in_pool(pool_id)]

    def warnings(self) -> list[str]:
        """Unhealthy workers: worth reporting, fatal only when their pool has no other."""
        return [f"worker {w.worker_id} unhealthy: {w.reason}"
                for w in sorted(self.workers.values(), key=lambda w: w.worker_id)
                if not w.is_healthy]

    def healthy_in_pool(self, pool_id: int) -> bool:
        return any(w.is_healthy for w in self.workers.values() if w.pool_id == pool_id)

    def is_healthy(self, worker_id: int) -> bool:
        worker = self.workers.get(worker_id)
        return worker is not None and worker.is_healthy

    def table(self, now_s: float | None = None) -> list[dict]:
        now = _now(now_s)
        return [w.as_dict(now) for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]


def _now(now_s: float | None) -> float:
    return time.monotonic() if now_s is None else now_s
