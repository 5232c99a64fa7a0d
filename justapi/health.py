"""Worker health table kept by the scheduler process: heartbeats, progress, verdicts.

Workers send a Heartbeat every HEARTBEAT_INTERVAL_S; one silent for HEARTBEAT_TIMEOUT_S is
unhealthy (so a dead or stopped worker is caught within 2 s), as is one that reports a fatal
condition. Pure logic with times passed in, testable without processes.
Owns: the health table. Does not own: what happens to an unhealthy worker's requests (core).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from justapi.protocol import Heartbeat

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 1.5


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

    def as_dict(self) -> dict:
        return {"worker_id": self.worker_id, "pool_id": self.pool_id, "healthy": self.is_healthy,
                "reason": self.reason, "rss_bytes": self.rss_bytes,
                "cpu_time_s": round(self.cpu_time_s, 3), "gpu": self.gpu}


class HealthMonitor:
    def __init__(self, timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.workers: dict[int, WorkerHealth] = {}

    def add_worker(self, worker_id: int, pool_id: int, now_s: float | None = None) -> None:
        now = _now(now_s)
        self.workers[worker_id] = WorkerHealth(worker_id, pool_id, now, now)

    def on_heartbeat(self, beat: Heartbeat, now_s: float | None = None) -> None:
        worker = self.workers.get(beat.worker_id)
        if worker is None:
            return
        worker.last_heartbeat_s = _now(now_s)
        worker.rss_bytes, worker.cpu_time_s, worker.gpu = beat.rss_bytes, beat.cpu_time_s, beat.gpu
        fatal = beat.gpu.get("fatal") if isinstance(beat.gpu, dict) else None
        if fatal and worker.is_healthy:
            worker.reason = str(fatal)
            worker.last_heartbeat_s = float("-inf")  # reported by newly_unhealthy

    def on_progress(self, worker_id: int, now_s: float | None = None) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_progress_s = _now(now_s)

    def newly_unhealthy(self, now_s: float) -> list[tuple[int, str]]:
        """Workers that just crossed into unhealthy, with why; each reported once."""
        out = []
        for worker in self.workers.values():
            silent_s = now_s - worker.last_heartbeat_s
            if worker.is_healthy and silent_s > self.timeout_s:
                worker.is_healthy = False
                worker.reason = worker.reason or f"no heartbeat for {silent_s:.1f}s"
                out.append((worker.worker_id, worker.reason))
        return out

    def problems(self, pool_ids: list[int]) -> list[str]:
        out = [f"worker {w.worker_id} unhealthy: {w.reason}"
               for w in self.workers.values() if not w.is_healthy]
        for pool_id in pool_ids:
            if not any(w.is_healthy for w in self.workers.values() if w.pool_id == pool_id):
                out.append(f"pool {pool_id} has no healthy worker")
        return out

    def is_healthy(self, worker_id: int) -> bool:
        worker = self.workers.get(worker_id)
        return worker is not None and worker.is_healthy

    def table(self) -> list[dict]:
        return [w.as_dict() for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]


def _now(now_s: float | None) -> float:
    return time.monotonic() if now_s is None else now_s
