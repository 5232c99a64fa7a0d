"""Start the process pool, wait for every Ready, and stop it in order with nothing left behind.

Where the workers run is a Placement passed in (placement.py): local processes (the
default; their CPU KV pool created before and unlinked after them) or Ray actors
(justapi/cluster/placement.py). The launcher starts the scheduler, the local workers and the
frontend as `python -m` children with a JSON spec, and waits for each one's ProcessReady on
a control socket. On SIGINT/SIGTERM it stops frontend (which first lets in-flight requests
finish, shutdown-grace-s), then scheduler, then workers; stragglers are killed; then the
placement closes (pools, remote workers) and the runtime dir goes.
A local worker that dies while serving goes to the supervisor (supervisor.py), which logs
it and, with --restart-workers, starts a replacement. A scheduler that dies is replaced
(--restart-scheduler, on by default) by a standby scheduler started ahead (it has loaded
what takes long and waits for the word on its stdin) or a new process; the pool stops only
when it may not be.
Owns: child processes, the runtime dir, the control socket. Does not own: what the children
do, where the workers run (the placement).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from justapi.config.serve import API_KEY_ENV, ServeConfig
from justapi.launch.child import ChildSpec, Endpoints
from justapi.launch.placement import LocalPlacement, Placement
from justapi.launch.supervisor import SchedulerSupervisor, WorkerSupervisor, describe_exit
from justapi.model.info import ModelInfo
from justapi.wire import transport
from justapi.wire.protocol import FenceWorker, ProcessFailed, ProcessReady

logger = logging.getLogger(__name__)

ROLE_MODULES = {
    "frontend": "justapi.frontend.process",
    "scheduler": "justapi.scheduler.process",
    "worker": "workers.process",
}
STOP_ORDER = ("frontend", "scheduler", "worker")
STOP_GRACE_S = 10.0
WAIT_POLL_S = 0.05  # how soon a dead scheduler is noticed (and its successor started)
STANDBY_DELAY_S = 10.0  # a new standby scheduler starts this long after the last one took over


class LaunchError(RuntimeError):
    """A process failed to start; the message names it and says why, in one line."""


@dataclass
class Child:
    role: str
    index: int
    process: subprocess.Popen
    ready: ProcessReady | None = None

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}" if self.role == "worker" else self.role


@dataclass
class Deployment:
    """What start() found: shown to the user and used by tests."""

    model: ModelInfo
    endpoints: Endpoints
    http_url: str
    zmq_url: str
    pool: dict[str, Any]
    children: list[Child] = field(default_factory=list)


class Launcher:
    def __init__(self, config: ServeConfig, model: ModelInfo, placement: Placement | None = None,
                 *, api_key: str = "") -> None:
        """placement: where the workers run (default: local processes); api_key: the HTTP
        API key, handed to the frontend in its environment only."""
        self.config = config
        self.model = model
        self.placement = placement if placement is not None else LocalPlacement(config, model)
        self._api_key = api_key
        self.runtime_dir = transport.make_runtime_dir()
        self.endpoints = Endpoints.in_dir(self.runtime_dir, config.server.zmq, config.ops.admin)
        self.children: list[Child] = []
        self.pool: dict[str, Any] = {}
        self.supervisor = WorkerSupervisor(config.ops, self._respawn)
        self.scheduler_supervisor = SchedulerSupervisor(config.ops)
        self.standby: Child | None = None  # a scheduler started ahead (restart-scheduler)
        self._standby_due_s = 0.0  # when to start one (monotonic; inf: never again)
        self._context = zmq.Context()
        self._control = transport.make_socket(self._context, zmq.PULL, self.endpoints.control,
                                              bind=True)
        try:
            self.endpoints = self.placement.open(self.endpoints)
        except BaseException:
            self.shutdown()
            raise

    def start(self) -> Deployment:
        """Start every process and wait for its Ready; on any failure stop all and raise."""
        try:
            pool = self.pool = self.placement.place_workers()
            for role, index in self._roles():
                self._spawn(role, index, pool)
            self._wait_ready(self.config.server.ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        frontend = next(c for c in self.children if c.role == "frontend")
        assert frontend.ready is not None
        info = frontend.ready.info
        return Deployment(self.model, self.endpoints, info.get("http_url", ""),
                          info.get("zmq", self.endpoints.client), pool, self.children)

    def _roles(self) -> list[tuple[str, int]]:
        workers = [("worker", i) for i in self.placement.local_workers()]
        return [("scheduler", 0), *workers, ("frontend", 0)]

    def _spawn(self, role: str, index: int, pool: dict[str, Any], *,
               standby: bool = False) -> Child:
        """Start one child (a standby scheduler: not among the children until promoted)."""
        if role == "worker":
            pool = self.placement.worker_pool(index)
        extra: dict[str, Any] = {"num_workers": self.config.server.workers}
        if role == "scheduler":  # how it reaches the workers (Ray: tcp + CURVE, its host)
            extra.update(self.placement.scheduler_extra())
            extra["num_restarts"] = self.scheduler_supervisor.num_restarts
            extra["standby"] = standby
        if role == "frontend":  # it watches the scheduler's process (a SIGKILL -> 503s at once)
            extra["scheduler_pid"] = next((c.process.pid for c in self.children
                                           if c.role == "scheduler"), 0)
        spec = ChildSpec(role=role, index=index, config=self.config, endpoints=self.endpoints,
                         model_path=self.model.path, pool=pool, extra=extra)
        process = subprocess.Popen([sys.executable, "-m", ROLE_MODULES[role], spec.to_json()],
                                   env=self.child_env(role),
                                   stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
                                   start_new_session=True)
        child = Child(role, index, process)
        if not standby:
            self.children.append(child)
        return child

    def child_env(self, role: str) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if role == "worker" and self.config.model.device == "cpu":
            # A CPU worker's OpenMP threads share the cores with the frontend, the scheduler
            # and other workers: a thread that waits at a barrier must sleep, not spin the
            # others out (tiny model, 64 streams: 4421 -> 7650 tok/s through HTTP).
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            # ... but waking a sleeping thread at each of a step's ~150 parallel regions costs
            # a big model's step 5-20%: a short spin first (cpu_spin_count).
            spin = cpu_spin_count(self.config, self.model, os.cpu_count() or 1)
            if self.config.server.cpu_spin >= 0:  # set on purpose: it wins over the env
                env.pop("GOMP_SPINCOUNT", None)
            if spin:
                env.setdefault("GOMP_SPINCOUNT", str(spin))
        env.pop(API_KEY_ENV, None)
        if role == "frontend" and self._api_key:  # only the frontend checks the HTTP API key
            env[API_KEY_ENV] = self._api_key
        return env

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        while any(c.ready is None for c in self.children):
            self._check_exits(starting=True)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = ", ".join(c.name for c in self.children if c.ready is None)
                raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for: {pending}")
            if poller.poll(timeout=int(min(remaining, 0.2) * 1000)):
                for _, message in transport.drain(self._control):
                    self._on_control(message)

    def _on_control(self, message: Any) -> None:
        if isinstance(message, FenceWorker):  # a worker the scheduler cannot signal (Ray)
            self.placement.fence(message)
        elif isinstance(message, ProcessFailed):
            who = message.role if message.role != "worker" else f"worker {message.index}"
            raise LaunchError(f"{who} failed to start: {message.error}")
        if isinstance(message, ProcessReady):
            for child in self.children:
                if child.role == message.role and child.index == message.index:
                    child.ready = message

    def _check_exits(self, *, starting: bool) -> Child | None:
        if starting:  # a worker outside the launcher's children failed to start: LaunchError
            self.placement.check(starting=True)
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                if starting:
                    raise LaunchError(f"{child.name} exited with code {code} while starting "
                                      "(see its log above)")
                return child
        return None

    def wait(self, stop_requested: Any) -> str:
        """Block until stop_requested() or a frontend/scheduler dies; return why. A dead
        worker is the supervisor's or the placement's (restart or not), and the scheduler's
        (fence, re-queue)."""
        while not stop_requested():
            dead = next((c for c in self.children
                         if c.role != "worker" and c.process.poll() is not None), None)
            if dead is not None and not self._restart_scheduler(dead):
                return f"{dead.name} exited with code {dead.process.returncode}"
            self._keep_standby()
            self.supervisor.check(self.children)
            self.placement.check(starting=False)
            for _, message in transport.drain(self._control):
                if isinstance(message, ProcessFailed):
                    logger.error("%s %d failed: %s", message.role, message.index, message.error)
                else:
                    self._on_control(message)  # a replacement worker's ProcessReady
            time.sleep(WAIT_POLL_S)
        return "stop requested"

    def _restart_scheduler(self, child: Child) -> bool:
        """A dead scheduler's successor, when the supervisor allows one (False: stop the pool):
        the standby, promoted, else a new process. The workers and the frontend stay; the
        new scheduler takes them over."""
        if child.role != "scheduler" or not self.scheduler_supervisor.on_exit(
                child.process.pid, child.process.returncode):
            return False
        self.children.remove(child)
        standby, self.standby = self.standby, None
        self._standby_due_s = time.monotonic() + STANDBY_DELAY_S
        if standby is not None and _promote(standby, self.scheduler_supervisor.num_restarts):
            self.children.append(standby)
        else:
            self._spawn("scheduler", 0, self.pool)
        return True

    def _keep_standby(self) -> None:
        """With restart-scheduler, one standby scheduler started ahead (standby.py): after
        start-up, and STANDBY_DELAY_S after each promotion (not to compete with the take-over
        for the cores). One that exits on its own is not replaced: restarts start cold."""
        if not (self.config.ops.restart_scheduler and self.config.ops.standby_scheduler):
            return
        if self.standby is None:
            if time.monotonic() >= self._standby_due_s:
                self.standby = self._spawn("scheduler", 0, self.pool, standby=True)
            return
        code = self.standby.process.poll()
        if code is not None:
            logger.error("the standby scheduler (pid %d) exited with %s; a restart will start "
                         "a new scheduler instead", self.standby.process.pid, describe_exit(code))
            _close_stdin(self.standby.process)
            self._standby_due_s = float("inf")
            self.standby = None

    def _respawn(self, child: Any) -> None:
        self.children.remove(child)
        self._spawn(child.role, child.index, self.pool)

    def _stop_group(self, role: str) -> list[Child]:
        group = [c for c in self.children if c.role == role and c.process.poll() is None]
        if role == "scheduler" and self.standby is not None:
            _close_stdin(self.standby.process)  # it stops on EOF as on SIGTERM
            group.append(self.standby)
            self.standby = None
        return group

    def shutdown(self) -> None:
        """Stop children in order (SIGTERM, grace, SIGKILL); close the placement (the CPU
        pool, Ray's workers); remove the dir."""
        for role in STOP_ORDER:
            group = self._stop_group(role)
            for child in group:
                _signal(child.process, signal.SIGTERM)
            # the frontend first lets in-flight requests finish (shutdown-grace-s)
            grace_s = STOP_GRACE_S + (self.config.server.shutdown_grace_s
                                      if role == "frontend" else 0.0)
            deadline = time.monotonic() + grace_s
            for child in group:
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in %.0fs; killing it", child.name, grace_s)
                    _signal(child.process, signal.SIGKILL)
                    child.process.wait()
        self.placement.close()
        self._control.close(0)
        self._context.term()
        transport.remove_runtime_dir(self.runtime_dir)


AUTO_CPU_SPIN = 10_000
"""GOMP_SPINCOUNT under cpu_spin=-1: ~0.25 ms of spinning on a 2-core EPYC VM. SmolLM2, 16
sequences, 2 threads, median decode step in turns: 54.6-54.9 ms sleeping at once, 49.6-51.2 ms
with this spin, 47.6-52.1 ms spinning without end (docs/runtime.md has the command)."""
AUTO_SPIN_MIN_WEIGHTS = 1 << 22
"""Auto spins for models with num_layers x hidden_size^2 at least this (SmolLM2-135M: 10M):
a tiny model's step is a few ms, and a quarter of a ms of spinning after each of its
parallel regions takes the core that the frontend and scheduler need (64 streams of a
synthetic 1-layer model, alternating runs: 8,537-8,753 -> 5,470-5,924 tok/s through HTTP)."""


def cpu_spin_count(config: ServeConfig, model: ModelInfo, cores: int) -> int:
    """The GOMP_SPINCOUNT for the CPU workers of `model` (0: none, sleep at once). Auto spins
    only where the workers' threads together fit the cores: where they outnumber them (PD's
    decode workers beside the prefill threads, a large --threads) a spinning thread holds a
    core another worker's thread is waiting for."""
    if config.server.cpu_spin >= 0:
        return config.server.cpu_spin
    workers = config.server.workers
    threads = sum(config.cpu_worker_threads(i, workers, cores) for i in range(workers))
    weights = model.num_layers * model.hidden_size ** 2
    return AUTO_CPU_SPIN if weights >= AUTO_SPIN_MIN_WEIGHTS and threads <= cores else 0


def _promote(standby: Child, num_restarts: int) -> bool:
    """Tell a standby scheduler to take over (it reads the count on its stdin)."""
    process = standby.process
    if process.poll() is not None or process.stdin is None:
        return False
    try:
        process.stdin.write(f"{num_restarts}\n".encode())
        process.stdin.flush()
    except OSError:  # it died meanwhile
        _signal(process, signal.SIGKILL)
        return False
    _close_stdin(process)
    return True


def _close_stdin(process: subprocess.Popen) -> None:
    if process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:
            pass


def _signal(process: subprocess.Popen, signum: int) -> None:
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        pass
