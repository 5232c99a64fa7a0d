"""The Ray workers' lifecycles as seen from the launcher: authorize, start, watch, restart.

Each worker slot moves through one Ray call at a time, polled without blocking:

    identity (its public key) -> authorized (written to the scheduler's keys file) ->
    start (load, map, connect) -> running (wait_stopped: returns at shutdown, fails when the
    process dies) -> identity again once Ray has restarted the actor (its __init__ made a new
    key pair), or down when Ray will not restart it (max-restarts spent, node gone)

Ray restarts the process (max_restarts); this only re-admits the new process. The scheduler
has already re-queued the dead worker's requests (missed heartbeats). A fence order from the
scheduler (FenceWorker) kills the actor's process if it is still the one the verdict named.
Owns: the slots and their transitions. Does not own: placement or Ray start-up
(justapi/cluster/placement.py), the actors (justapi/cluster/actors.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from justapi.wire.protocol import FenceWorker

logger = logging.getLogger(__name__)

RETRY_S = 0.5  # a call that found the actor between processes is asked again after this


class WorkerStartError(RuntimeError):
    """A worker could not start; the message names it and says why."""


@dataclass(eq=False)
class WorkerSlot:
    index: int
    actor: Any  # ray ActorHandle
    node_id: str
    host: str
    pool: dict[str, Any] = field(default_factory=dict)  # the host's segment ({} on a GPU)
    state: str = "identity"  # identity | starting | running | stopped | down
    pending: Any = None  # ObjectRef of the call in progress
    retry_at_s: float = 0.0
    public_key: str = ""
    pid: int = 0
    num_restarts: int = 0
    error: str = ""


class RayWorkerSupervisor:
    """The Ray actor workers' slots, polled by the launcher through RayPlacement.check()."""

    def __init__(self, ray: Any, authorize: Callable[[int, str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ray = ray
        self._authorize = authorize
        self._clock = clock
        self.slots: list[WorkerSlot] = []
        self.num_restarts = 0

    def add(self, slot: WorkerSlot) -> None:
        slot.pending = slot.actor.identity.remote()
        self.slots.append(slot)

    def check(self, *, starting: bool = False) -> None:
        """Advance every slot whose call returned. Starting: a failure raises WorkerStartError."""
        for slot in self.slots:
            if slot.pending is None:
                self._maybe_retry(slot)
                continue
            ready, _ = self._ray.wait([slot.pending], timeout=0)
            if ready:
                self._advance(slot, starting)

    def _advance(self, slot: WorkerSlot, starting: bool) -> None:
        exceptions = self._ray.exceptions
        ref, slot.pending = slot.pending, None
        try:
            value = self._ray.get(ref)
        except exceptions.ActorDiedError as exc:
            self._down(slot, _first_line(exc), starting)
        except exceptions.RayActorError:  # between processes: Ray is restarting it
            self._lost(slot, starting)
        except exceptions.RayTaskError as exc:  # start() raised: it cannot run there
            cause = exc.cause if exc.cause is not None else exc
            self._ray.kill(slot.actor, no_restart=True)
            self._down(slot, f"{type(cause).__name__}: {_first_line(cause)}", starting)
        else:
            self._on_value(slot, value)

    def _on_value(self, slot: WorkerSlot, value: Any) -> None:
        if slot.state == "identity":
            slot.public_key, slot.pid = value["public_key"], value["pid"]
            self._authorize(slot.index, slot.public_key)
            slot.state, slot.pending = "starting", slot.actor.start.remote(slot.pool)
        elif slot.state == "starting":
            logger.info("worker %d (pid %d) started on host %s (%s)", slot.index, value["pid"],
                        value["host"], value["device"])
            slot.state, slot.pending = "running", slot.actor.wait_stopped.remote()
        elif slot.state == "running":
            slot.state = "stopped"

    def _lost(self, slot: WorkerSlot, starting: bool) -> None:
        if starting:
            raise WorkerStartError(f"worker {slot.index} on host {slot.host} died while starting")
        if slot.state == "running":
            slot.num_restarts += 1
            self.num_restarts += 1
            logger.warning("worker %d (pid %d) on host %s died; Ray restarts it (restart %d)",
                           slot.index, slot.pid, slot.host, slot.num_restarts)
        slot.state, slot.retry_at_s = "identity", self._clock() + RETRY_S

    def _maybe_retry(self, slot: WorkerSlot) -> None:
        if slot.state == "identity" and self._clock() >= slot.retry_at_s:
            slot.pending = slot.actor.identity.remote()

    def _down(self, slot: WorkerSlot, why: str, starting: bool) -> None:
        slot.state, slot.error = "down", why
        if starting:
            raise WorkerStartError(f"worker {slot.index} on host {slot.host} failed to start: "
                                   f"{why}")
        logger.error("worker %d on host %s is down for good (Ray will not restart it): %s",
                     slot.index, slot.host, why)

    def fence(self, order: FenceWorker, may_restart: bool) -> bool:
        """Kill the worker's process if it is still the one the scheduler's verdict is about."""
        slot = next((s for s in self.slots if s.index == order.worker_id), None)
        if slot is None or slot.pid != order.pid or slot.state != "running":
            return False
        logger.warning("fencing worker %d (pid %d) on host %s: %s", slot.index, slot.pid,
                       slot.host, order.reason)
        self._ray.kill(slot.actor, no_restart=not may_restart)
        return True

    def stop_all(self, timeout_s: float) -> None:
        """Stop every worker loop (briefly), then the actors."""
        refs = [slot.actor.stop.remote() for slot in self.slots if slot.state != "down"]
        if refs:
            self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for slot in self.slots:
            self._ray.kill(slot.actor, no_restart=True)
            slot.state = "stopped"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("Traceback", "File ", "ray::"))]
    return (useful or lines or [type(exc).__name__])[-1][:300]
