"""The scheduler process's health duties around the health table (justapi/health/table.py).

Feeds the table from worker messages, checks that each worker's process still exists, polls
NVML for the GPUs the workers use (through an injectable reader; CPU figures only where there
is none), and turns the table into verdicts: which workers to retire now, and the problems
(503) and warnings that /health, /metrics and the admin tools show. Retiring a worker fences
it first (SIGKILL): a stopped or hung worker must never write KV again into blocks the core
hands to other requests. Where the workers run is a HostTable passed in: OneHost (all on this
host, the default) or HostHealth (several hosts: cluster.py).
Owns: clocks, /proc and signals for health. Does not own: the table's rules (table.py),
what is fatal on a GPU (gpu_faults.py), the requests of a retired worker (scheduler core).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from justapi.config.ops import OpsConfig
from justapi.health.gpu_faults import GpuFaults
from justapi.health.nvml import GpuReader, open_gpu_reader
from justapi.health.table import HealthMonitor
from justapi.wire.protocol import Heartbeat, Ready, TokenDeltas

logger = logging.getLogger(__name__)

LIVENESS_INTERVAL_S = 0.1


@dataclass(frozen=True)
class HealthSnapshot:
    """Everything the frontend (SchedulerStats) and the admin tools (StatusReply) show."""

    healthy: bool
    problems: list[str]
    warnings: list[str]
    stats: dict[str, float]
    workers: list[dict]
    gpus: list[dict]
    nvml: str
    uptime_s: float


class HostTable(Protocol):
    """Where each worker runs, as far as health needs to know: whose process this host's /proc
    and signals reach, how to fence the others, and what the snapshot says about hosts."""

    def on_ready(self, ready: Ready) -> None: ...

    def is_local(self, worker_id: int) -> bool: ...

    def fence_remote(self, worker_id: int, pid: int, reason: str) -> bool: ...

    def annotate(self, snapshot: HealthSnapshot) -> HealthSnapshot: ...


class OneHost:
    """Every worker runs on this host (launcher = "local"): /proc sees it, SIGKILL fences it."""

    def on_ready(self, ready: Ready) -> None:
        pass

    def is_local(self, worker_id: int) -> bool:
        return True

    def fence_remote(self, worker_id: int, pid: int, reason: str) -> bool:
        return False

    def annotate(self, snapshot: HealthSnapshot) -> HealthSnapshot:
        return snapshot


class HealthWatch:
    def __init__(self, config: OpsConfig, *, hosts: HostTable | None = None,
                 launcher_pid: int | None = None,
                 gpu_opener: Callable[[list[int]], tuple[GpuReader | None, str]] = open_gpu_reader,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.hosts: HostTable = hosts if hosts is not None else OneHost()
        self.monitor = HealthMonitor(config.heartbeat_timeout_s, config.step_timeout_s)
        self.faults = GpuFaults(config.thermal_hold_s)
        self.launcher_pid = os.getppid() if launcher_pid is None else launcher_pid
        self.gpu_reader: GpuReader | None = None
        self.nvml_status = ""  # set by the first GPU poll
        self.gpus: dict[int, dict] = {}  # latest NVML reading by CUDA index
        self._gpu_opener = gpu_opener
        self._devices: dict[int, tuple[int, str]] = {}  # worker -> (CUDA index, GPU UUID)
        self._owns_pool: dict[int, bool] = {}  # the pool's memory dies with the worker
        self._clock = clock
        self.started_s = clock()
        self._last_liveness_s = float("-inf")
        self._last_gpu_poll_s = float("-inf")
        self._progress_s = self.started_s  # last step result, or when work appeared

    # ------------------------------------------------------------------ worker messages
    def on_ready(self, ready: Ready) -> None:
        self.monitor.add_worker(ready.worker_id, ready.pool.pool_id, self._clock(),
                                pid=ready.pid, device=ready.pool.device)
        self._owns_pool[ready.worker_id] = ready.pool.kind not in ("shm", "local")
        cuda_index = cuda_index_of(ready.pool.device)
        if cuda_index is not None:
            self._devices[ready.worker_id] = (cuda_index, "")
        self.hosts.on_ready(ready)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        self.monitor.on_heartbeat(beat, self._clock())
        uuid = beat.gpu.get("uuid") if isinstance(beat.gpu, dict) else None
        if uuid and beat.worker_id in self._devices:
            self._devices[beat.worker_id] = (self._devices[beat.worker_id][0], str(uuid))

    def on_step_sent(self, worker_id: int, step_id: int) -> None:
        self.monitor.on_step_sent(worker_id, step_id, self._clock())

    def on_step_result(self, worker_id: int) -> None:
        now = self._clock()
        self.monitor.on_progress(worker_id, now)
        self._progress_s = now

    def on_unreachable(self, worker_id: int, error: str) -> None:
        self.monitor.report_fatal(worker_id, f"unreachable ({error})")

    # ------------------------------------------------------------------ checks
    def poll(self) -> list[tuple[int, str]]:
        """Run the checks that are due; the workers that just became unhealthy, with why."""
        now = self._clock()
        if now - self._last_liveness_s >= LIVENESS_INTERVAL_S:
            self._last_liveness_s = now
            self._check_processes()
        if now - self._last_gpu_poll_s >= self.config.gpu_poll_interval_s:
            self._last_gpu_poll_s = now
            self._poll_gpus(now)
        return self.monitor.newly_unhealthy(now)

    def _check_processes(self) -> None:
        """Only this host's workers have their pid in this host's /proc."""
        for worker in self.monitor.workers.values():
            if worker.is_healthy and worker.pid > 0 and self.hosts.is_local(worker.worker_id):
                state = process_state(worker.pid)
                if state is None or state in "ZX":
                    self.monitor.report_fatal(worker.worker_id, f"process {worker.pid} exited")

    def _poll_gpus(self, now: float) -> None:
        if not self.nvml_status:
            indices = sorted({index for index, _ in self._devices.values()})
            self.gpu_reader, self.nvml_status = self._gpu_opener(indices)
        if self.gpu_reader is None:
            return
        for device in sorted(set(self._devices.values())):
            try:
                reading = self.gpu_reader.read(*device)
            except Exception:  # a reader bug must not take the scheduler down
                logger.exception("reading NVML for GPU cuda:%d failed", device[0])
                continue
            fatal = self.faults.check(reading, now)
            figures = {**reading.as_dict(), "xids": self.faults.recent_xids(device[0])}
            self.gpus[device[0]] = figures
            for worker_id, worker_device in self._devices.items():
                if worker_device == device:
                    self.monitor.on_gpu_reading(worker_id, figures)
                    if fatal:
                        self.monitor.report_fatal(worker_id, fatal)

    # ------------------------------------------------------------------ actions
    def retire(self, core: Any, worker_id: int) -> TokenDeltas:
        """Fence the worker, hand its requests back to the core (re-queued for recompute, or
        failed where no pool can serve them) and, when its pool's memory died with it and no
        worker of the pool is left, forget that pool's prefix cache."""
        self.fence(worker_id)
        deltas = core.mark_worker_unhealthy(worker_id)
        worker = self.monitor.workers.get(worker_id)
        if worker is not None and self._owns_pool.get(worker_id) \
                and not self.monitor.healthy_in_pool(worker.pool_id):
            core.flush_prefix_cache(worker.pool_id)
        return deltas

    def rejoin(self, core: Any, ready: Ready) -> TokenDeltas | None:
        """A worker sent Ready after start-up (a replacement): retire what the core still
        holds for the old process, then let the new one in."""
        deltas = None
        old = self.monitor.workers.get(ready.worker_id)
        if old is not None and old.is_healthy and old.pid != ready.pid:
            self.monitor.mark_unhealthy(ready.worker_id, f"replaced by process {ready.pid}")
            deltas = self.retire(core, ready.worker_id)
        self.on_ready(ready)
        try:
            core.add_worker(ready)
        except ValueError as exc:
            logger.error("worker %d (pid %d) cannot rejoin: %s", ready.worker_id, ready.pid, exc)
            self.monitor.report_fatal(ready.worker_id, f"cannot rejoin: {exc}")
            return deltas
        logger.info("worker %d (pid %d) joined on %s", ready.worker_id, ready.pid,
                    ready.pool.device)
        return deltas

    def fence(self, worker_id: int) -> bool:
        """SIGKILL the worker's process if it is on this host and still the launcher's child
        (so a pid the system reused is never hit); any other goes to the host table (on
        several hosts: an order to the launcher). True when a signal or an order went out."""
        worker = self.monitor.workers.get(worker_id)
        if worker is None or worker.pid <= 0:
            return False
        if self.hosts.is_local(worker_id) and self._kill_child(worker.pid):
            return True
        return self.hosts.fence_remote(worker_id, worker.pid, worker.reason or "unhealthy")

    def _kill_child(self, pid: int) -> bool:
        if parent_pid(pid) != self.launcher_pid:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    # ------------------------------------------------------------------ verdicts
    def snapshot(self, core: Any) -> HealthSnapshot:
        now = self._clock()
        stats = core.stats()
        workers = self.monitor.table(now)
        roles = core.worker_roles()
        for row in workers:
            prefix = f"worker_{row['worker_id']}_"
            row["role"] = roles.get(row["worker_id"], "mixed")  # PD: prefill | decode
            row["draining"] = bool(stats.get(prefix + "is_draining", 0.0))
            row["num_requests_running"] = int(stats.get(prefix + "num_requests_running", 0))
            row["busy"] = bool(stats.get(prefix + "is_busy", 0.0))
        problems = self.monitor.problems(core.pool_ids())
        problems += core.problems()  # PD: a side without a healthy worker
        problems += self._draining_problems(core.pool_ids(), workers)
        stall = self._stall(now, int(stats.get("num_requests_running", 0)
                                     + stats.get("num_requests_waiting", 0)))
        if stall:
            problems.append(stall)
        warnings = self.monitor.warnings() + [f"worker {row['worker_id']} is draining"
                                              for row in workers if row["draining"]]
        return self.hosts.annotate(HealthSnapshot(
            healthy=not problems, problems=problems, warnings=warnings, stats=stats,
            workers=workers, gpus=[self.gpus[i] for i in sorted(self.gpus)],
            nvml=self.nvml_status, uptime_s=now - self.started_s))

    def _draining_problems(self, pool_ids: list[int], workers: list[dict]) -> list[str]:
        out = []
        for pool_id in pool_ids:
            healthy = [row for row in workers if row["pool_id"] == pool_id and row["healthy"]]
            if healthy and all(row["draining"] for row in healthy):
                out.append(f"pool {pool_id}: every healthy worker is draining "
                           "(new requests wait for an undrain)")
        return out

    def _stall(self, now: float, num_unfinished: int) -> str:
        if num_unfinished == 0:
            self._progress_s = now
            return ""
        idle_s = now - self._progress_s
        if idle_s <= self.config.step_timeout_s:
            return ""
        return (f"not progressing: no step finished for {idle_s:.0f}s with "
                f"{num_unfinished} unfinished request(s)")

    def close(self) -> None:
        if self.gpu_reader is not None:
            self.gpu_reader.close()


def cuda_index_of(device: str) -> int | None:
    """'cuda:3' -> 3, 'cuda' -> 0, anything else (cpu) -> None."""
    if not device.startswith("cuda"):
        return None
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def process_state(pid: int) -> str | None:
    """The one-letter state from /proc/<pid>/stat (R, S, T, Z...); None if there is none."""
    fields = _proc_stat(pid)
    return fields[0] if fields else None


def parent_pid(pid: int) -> int:
    fields = _proc_stat(pid)
    return int(fields[1]) if fields else -1


def _proc_stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []
