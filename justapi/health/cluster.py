"""Health across hosts (launcher = "ray"): the HostTable that HealthWatch is given there.

A worker's process can only be checked in /proc and SIGKILLed from the host it runs on: for
a worker on another host the scheduler relies on its heartbeats (a dead host's workers fall
silent and are retired after `heartbeat-timeout-s`), and fencing one is an order to the
launcher (FenceWorker, sent by `fence_remote`), which has Ray kill its actor. Every row of the
health table names its host; a host whose every worker is down is a warning of its own, and
so is its pool's having no healthy worker while another host serves (its requests were
re-queued there): a lost host degrades the server, it does not take it out of a load balancer.
Owns: the worker -> host table and the snapshot's host view. Does not own: the rules
(HealthWatch), the fence order's socket (the scheduler process).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from justapi.health.watch import HealthSnapshot
from justapi.wire.protocol import Ready


class HostHealth:
    def __init__(self, local_host: str, fence_remote: Callable[[int, int, str], None]) -> None:
        """local_host: the scheduler's host address; fence_remote(worker_id, pid, reason)
        asks the launcher to kill a worker's process wherever it runs."""
        self.local_host = local_host
        self._fence_remote = fence_remote
        self.hosts: dict[int, str] = {}  # worker id -> the host of its pool

    def on_ready(self, ready: Ready) -> None:
        self.hosts[ready.worker_id] = ready.pool.host

    def is_local(self, worker_id: int) -> bool:
        return self.hosts.get(worker_id, self.local_host) == self.local_host

    def fence_remote(self, worker_id: int, pid: int, reason: str) -> bool:
        self._fence_remote(worker_id, pid, reason)
        return True

    def annotate(self, snapshot: HealthSnapshot) -> HealthSnapshot:
        """Each worker's host; a lost host (none of its workers healthy) is a warning while
        another host serves (its pool's requests went elsewhere)."""
        for row in snapshot.workers:
            row["host"] = self.hosts.get(row["worker_id"], self.local_host)
        by_host = _by_host(snapshot.workers)
        lost = [host for host, rows in by_host.items() if not any(row["healthy"] for row in rows)]
        warnings = snapshot.warnings + [f"host {host or 'local'} lost: none of its "
                                        f"{len(by_host[host])} worker(s) is healthy"
                                        for host in lost]
        problems = snapshot.problems
        if any(row["healthy"] for row in snapshot.workers):
            lost_pools = {f"pool {row['pool_id']} has no healthy worker"
                          for host in lost for row in by_host[host]}
            warnings += [p for p in problems if p in lost_pools]
            problems = [p for p in problems if p not in lost_pools]
        return dataclasses.replace(snapshot, healthy=not problems, problems=problems,
                                   warnings=warnings)


def _by_host(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(str(row.get("host", "")), []).append(row)
    return out
