"""Health duties for workers on several hosts: HealthWatch, host-aware.

A worker's process can only be checked in /proc and SIGKILLed from the host it runs on: for
a worker on another host the scheduler relies on its heartbeats (a dead host's workers fall
silent and are retired after `heartbeat-timeout-s`), and fencing one is an order to the
launcher (FenceWorker), which has Ray kill its actor. Every row of the health table names
its host; a host whose every worker is down is a warning of its own, and so is its pool's
having no healthy worker while another host serves (its requests were re-queued there): a
lost host degrades the server, it does not take it out of a load balancer.
Owns: the worker -> host table and the remote fence. Does not own: the rules (HealthWatch).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from justapi.config.ops import OpsConfig
from justapi.health.watch import HealthSnapshot, HealthWatch, process_state
from justapi.wire.protocol import Ready


class ClusterHealthWatch(HealthWatch):
    def __init__(self, config: OpsConfig, local_host: str,
                 fence_remote: Callable[[int, int, str], None], **options: Any) -> None:
        super().__init__(config, **options)
        self.local_host = local_host
        self._fence_remote = fence_remote
        self.hosts: dict[int, str] = {}  # worker id -> the host of its pool

    def on_ready(self, ready: Ready) -> None:
        super().on_ready(ready)
        self.hosts[ready.worker_id] = ready.pool.host

    def is_local(self, worker_id: int) -> bool:
        return self.hosts.get(worker_id, self.local_host) == self.local_host

    def _check_processes(self) -> None:
        """Only this host's workers have their pid in this host's /proc."""
        for worker in self.monitor.workers.values():
            if worker.is_healthy and worker.pid > 0 and self.is_local(worker.worker_id):
                state = process_state(worker.pid)
                if state is None or state in "ZX":
                    self.monitor.report_fatal(worker.worker_id, f"process {worker.pid} exited")

    def fence(self, worker_id: int) -> bool:
        if self.is_local(worker_id) and super().fence(worker_id):
            return True
        worker = self.monitor.workers.get(worker_id)
        if worker is None or worker.pid <= 0:
            return False
        self._fence_remote(worker_id, worker.pid, worker.reason or "unhealthy")
        return True

    def snapshot(self, core: Any) -> HealthSnapshot:
        """HealthWatch's, with each worker's host; a lost host (none of its workers healthy)
        is a warning while another host serves (its pool's requests went elsewhere)."""
        snap = super().snapshot(core)
        for row in snap.workers:
            row["host"] = self.hosts.get(row["worker_id"], self.local_host)
        by_host = _by_host(snap.workers)
        lost = [host for host, rows in by_host.items() if not any(row["healthy"] for row in rows)]
        warnings = snap.warnings + [f"host {host or 'local'} lost: none of its "
                                    f"{len(by_host[host])} worker(s) is healthy" for host in lost]
        problems = snap.problems
        if any(row["healthy"] for row in snap.workers):
            lost_pools = {f"pool {row['pool_id']} has no healthy worker"
                          for host in lost for row in by_host[host]}
            warnings += [p for p in problems if p in lost_pools]
            problems = [p for p in problems if p not in lost_pools]
        return dataclasses.replace(snap, healthy=not problems, problems=problems,
                                   warnings=warnings)


def _by_host(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(str(row.get("host", "")), []).append(row)
    return out
