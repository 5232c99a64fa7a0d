"""The scheduler process: the IO shell around the pure scheduler core.

Reads SubmitRequest/AbortRequest from the frontend and Ready/StepResult/Heartbeat from the
workers, asks the core for step plans, and pushes coalesced TokenDeltas and periodic
SchedulerStats back to the frontend; answers the admin socket between steps (admin.py).
How it reaches the workers is chosen from its spec (worker_links.py): on this host, or on
other hosts (launcher = "ray": CURVE, KV copies relayed, fences through the launcher).
Never busy-polls: it blocks on its sockets, and every change of state arrives as a message.
A scheduler the launcher restarted (the old one died; usually a standby it started ahead,
standby.py) starts with an empty core: it takes its running workers over (AttachWorker ->
Ready), then tells the frontend (SchedulerStarted), which resubmits every open request with
the tokens it already delivered.
Owns: sockets, clocks, the workers' Ready table. Does not own: scheduling decisions
(the core), health verdicts and fencing (justapi/health/watch.py), tokens-to-text.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from typing import Any

import numpy as np
import zmq

from justapi.health.watch import HealthWatch
from justapi.launch.child import ChildSpec, StopFlag, report, start_child
from justapi.ops.timeline import Timeline
from justapi.scheduler.admin import AdminServer
from justapi.scheduler.factory import PreparedModel, build_scheduler, prepare_model
from justapi.scheduler.kv.publisher import KvEvents, open_kv_events
from justapi.scheduler.standby import wait_for_takeover
from justapi.scheduler.worker_links import open_links
from justapi.wire import transport
from justapi.wire.ids import heartbeat_identity, worker_identity
from justapi.wire.protocol import (
    FINISH_ERROR,
    AbortRequest,
    AttachWorker,
    BlockData,
    BlocksCopied,
    Heartbeat,
    Ready,
    SchedulerStarted,
    SchedulerStats,
    Shutdown,
    StepPlan,
    StepResult,
    SubmitRequest,
    TokenDeltas,
)

logger = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 100
ATTACH_POLL_MS = 10  # a restarted scheduler looks for its workers' reconnections this often
STATS_INTERVAL_S = 0.5


class SchedulerProcess:
    def __init__(self, spec: ChildSpec, stop: StopFlag,
                 prepared: PreparedModel | None = None) -> None:
        """prepared: the model's tokenizer, loaded ahead by a standby (standby.py); else it is
        loaded at start-up."""
        self.spec = spec
        self.stop = stop
        self.prepared = prepared
        self.pid = os.getpid()
        self.num_workers = int(spec.extra.get("num_workers", spec.config.server.workers))
        self.num_restarts = int(spec.extra.get("num_restarts", 0))  # 0: the pool's first scheduler
        ctx = zmq.Context()
        self.context = ctx
        self.inbox = transport.make_socket(ctx, zmq.PULL, spec.endpoints.scheduler_in, bind=True)
        self.outbox = transport.make_socket(ctx, zmq.PUSH, spec.endpoints.frontend_in, bind=False)
        self.readies: dict[int, Ready] = {}
        self.links = open_links(ctx, spec, self.readies, self._is_healthy)
        self.workers = self.links.socket
        self.workers.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reuses its identity
        self.admin = AdminServer(ctx, spec.endpoints.admin)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self.workers, zmq.POLLIN)
        self.poller.register(self.admin.socket, zmq.POLLIN)
        self.health = HealthWatch(spec.config.ops, hosts=self.links.hosts)
        # Structured outputs: grammar compiles finish in a pool thread, which writes a byte
        # here so the loop (blocked on its sockets) wakes up to queue the request.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self.poller.register(self._wake_read, zmq.POLLIN)
        self.core: Any = None
        self.kv_events: KvEvents | None = None  # --kv-events (kv/publisher.py)
        self._last_stats_s = 0.0
        self.timeline = Timeline.from_env("scheduler")

    # ---------------------------------------------------------------- start-up
    def wait_for_workers(self, timeout_s: float) -> None:
        """Every worker's Ready, then the core. A restarted scheduler (num_restarts > 0) finds
        its workers running: it asks each for a Ready (AttachWorker) as soon as that worker's
        socket has reconnected; what they still send for the dead scheduler before it (results
        of its last plans, heartbeats) is dropped here."""
        deadline = time.monotonic() + timeout_s
        attached: set[int] = set()
        while len(self.readies) < self.num_workers and not self.stop.is_set:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_workers)) - set(self.readies))
                raise RuntimeError(f"no Ready from worker(s) {missing} in {timeout_s:.0f}s")
            if self.num_restarts:
                self._attach_workers(attached)
            if self.poller.poll(ATTACH_POLL_MS if self.num_restarts else POLL_TIMEOUT_MS):
                for sender, message in transport.drain(self.workers, routed=True):
                    if isinstance(message, Ready) and self._is_own(sender, message):
                        self.readies[message.worker_id] = message
                        self.health.on_ready(message)
        self.core = build_scheduler(self.spec.config, list(self.readies.values()),
                                    {**self.spec.extra, "model_path": self.spec.model_path},
                                    on_grammar=self._wake, prepared=self.prepared)
        self.kv_events = open_kv_events(self.spec.config.ops, self.spec.config.model.device,
                                        self.core.state.kv)
        if self.num_restarts:  # queued for the dead scheduler: the frontend resubmits it all
            stale = transport.drain(self.inbox)
            if stale:
                logger.info("dropped %d message(s) sent to the previous scheduler", len(stale))
        # the frontend resubmits what it holds to a scheduler it has not seen
        transport.send(self.outbox, SchedulerStarted(self.pid, self.num_restarts))

    def _attach_workers(self, attached: set[int]) -> None:
        """AttachWorker once to each worker whose socket is connected (the ROUTER refuses a
        send to one that is not yet: tried again next turn)."""
        for worker_id in range(self.num_workers):
            if worker_id in attached:
                continue
            try:
                transport.send(self.workers, AttachWorker(self.pid),
                               to=worker_identity(worker_id), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # not reconnected yet
                continue
            attached.add(worker_id)

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        """The loop. A message's failure stays with its request or is dropped (_on_frontend,
        _on_worker); any other part that raises is logged and the loop goes on: no exception
        ends the process (justapi/scheduler/faults.py, docs/reliability.md)."""
        while not self.stop.is_set:
            self.poller.poll(POLL_TIMEOUT_MS)
            self.timeline.mark("wake")
            for _, message in transport.drain(self.inbox):
                self._on_frontend(message)
            for sender, message in transport.drain(self.workers, routed=True):
                self._on_worker(sender, message)  # update: results -> deltas
            for part in (self._take_grammars, self._between_steps, self._schedule,
                         self._flush_kv_events, self._maybe_push_stats):
                try:
                    part()
                except Exception:
                    logger.exception("%s failed; the loop goes on", part.__name__.strip("_"))
        if self.kv_events is not None:
            self.kv_events.close()
        self._stop_workers()

    def _schedule(self) -> None:
        """Plans and copy orders out; then the requests that failed alone while planned."""
        for worker_id, order in self.core.schedule():
            self._execute(worker_id, order)
            self.timeline.mark("plan_out", getattr(order, "step_id", -1), worker_id)
        self._send_deltas(self.core.take_failures())

    def _flush_kv_events(self) -> None:
        """--kv-events: this iteration's block events out as one batch per pool."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def _wake(self) -> None:
        """A grammar compile finished (called in the compile thread)."""
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):  # the pipe is full (the loop will look) or closed
            pass

    def _take_grammars(self) -> None:
        """Queue requests whose grammar compiled; fail those whose grammar did not."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        self._send_deltas(self.core.poll_grammars())

    def _between_steps(self) -> None:
        """The admin socket, health verdicts (retire, fence), the core's clock (PD leases)."""
        self.admin.serve(self.core, self.health)
        self._check_health()
        self._send_deltas(self.core.tick(time.monotonic()))

    def _on_frontend(self, message: Any) -> None:
        """A request's message; anything but bad input (ValueError: rejected) that goes wrong
        while handling it fails that request alone ("admit", justapi/scheduler/faults.py)."""
        if isinstance(message, SubmitRequest):
            try:
                self._check_vocab(message)
                self.core.add_request(message)
            except ValueError as exc:
                self._reject(message.request_id, str(exc))
            except Exception as exc:
                self._fail_request(message.request_id, exc)
        elif isinstance(message, AbortRequest):
            for request_id in message.request_ids:
                try:
                    self._send_deltas(self.core.abort_request(request_id))
                except Exception as exc:
                    self._fail_request(request_id, exc)
        else:
            logger.warning("ignored unexpected %s from the frontend", type(message).__name__)

    def _fail_request(self, request_id: str, exc: Exception) -> None:
        deltas = self.core.fail_request(request_id, "admit", exc)
        if deltas is None:  # the core holds nothing of it
            self._reject(request_id, f"admit failed: {type(exc).__name__}: {exc}")
        else:
            self._send_deltas(deltas)

    def _check_vocab(self, request: SubmitRequest) -> None:
        """A token id past the vocabulary would fail the whole step it is batched in."""
        vocab_size = min((r.vocab_size for r in self.readies.values()), default=0)
        for ids in (request.prompt_token_ids, request.output_token_ids):
            if vocab_size and len(ids) and int(np.max(ids)) >= vocab_size:
                raise ValueError(f"request {request.request_id!r}: token id {int(np.max(ids))} "
                                 f"is not in the vocabulary [0, {vocab_size})")

    def _on_worker(self, sender: bytes | None, message: Any) -> None:
        """A worker's message; one the core cannot take (a result for no step in flight, a
        Ready that contradicts the pool) is logged and dropped: a step left unanswered ends
        with its worker's health (step timeout), never with this process."""
        if not self._is_own(sender, message):
            return
        try:
            self._take_worker_message(message)
        except Exception as exc:
            logger.error("dropped %s from worker %s: %s: %s", type(message).__name__,
                         getattr(message, "worker_id", "?"), type(exc).__name__, exc,
                         exc_info=not isinstance(exc, ValueError))

    def _take_worker_message(self, message: Any) -> None:
        if isinstance(message, StepResult):
            self.timeline.mark_cpu(message.step_id)
            self.timeline.mark("result_in", message.step_id, message.worker_id)
            self.health.on_step_result(message.worker_id)
            if message.error:
                logger.error("worker %d step %d failed: %s", message.worker_id, message.step_id,
                             message.error)
            self._send_deltas(self.core.update(message))
            self.timeline.mark("deltas_out", message.step_id)
        elif isinstance(message, BlocksCopied):  # a KV copy (PD hand-off, import) is in place
            self._send_deltas(self.core.copy_done(message))
        elif isinstance(message, Heartbeat):
            self.health.on_heartbeat(message)
        elif isinstance(message, BlockData):  # a relayed copy's chunk (workers on other hosts)
            self._send_all(self.links.forward(message))
        elif isinstance(message, Ready):
            self.readies[message.worker_id] = message
            self._send_deltas(self.health.rejoin(self.core, message))
        else:
            logger.warning("ignored unexpected %s", type(message).__name__)

    def _is_own(self, sender: bytes | None, message: Any) -> bool:
        """Only worker N's own socket may speak for worker N (a stray or hostile peer on the
        workers socket cannot forge results, heartbeats or a Ready)."""
        worker_id = getattr(message, "worker_id", None)
        if isinstance(worker_id, int):
            own = heartbeat_identity if isinstance(message, Heartbeat) else worker_identity
            if sender == own(worker_id):
                return True
        logger.warning("dropped %s from %r: not that worker's socket", type(message).__name__,
                       sender)
        return False

    def _is_healthy(self, worker_id: int) -> bool:
        return self.health.monitor.is_healthy(worker_id)

    def _send_deltas(self, deltas: TokenDeltas | None) -> None:
        if deltas is not None and deltas.request_ids:  # signed: see TokenDeltas.scheduler_pid
            transport.send(self.outbox, dataclasses.replace(deltas, scheduler_pid=self.pid))

    def _reject(self, request_id: str, error: str) -> None:
        transport.send(self.outbox, TokenDeltas(
            step_id=-1, request_ids=[request_id], num_new_tokens=np.zeros(1, np.int32),
            token_ids=np.zeros(0, np.int32), finish_reasons=[FINISH_ERROR],
            errors={request_id: error}, scheduler_pid=self.pid))

    def _execute(self, worker_id: int, order: Any) -> None:
        """Send a core order the way the links route it (a copy between hosts: relayed)."""
        self._send_all(self.links.route(worker_id, order))

    def _send_all(self, sends: list[tuple[int, Any]]) -> None:
        for worker_id, message in sends:
            self._send(worker_id, message)

    def _send(self, worker_id: int, message: Any) -> None:
        try:
            transport.send(self.workers, message, to=worker_identity(worker_id))
        except zmq.ZMQError as exc:  # its process is gone: retired at the next health check
            self.health.on_unreachable(worker_id, str(exc))
            return
        if isinstance(message, StepPlan):  # (a copy order or relayed chunk is not a step)
            self.health.on_step_sent(worker_id, message.step_id)

    def _check_health(self) -> None:
        for worker_id, reason in self.health.poll():
            logger.error("worker %d is unhealthy: %s; fencing it, re-queueing its requests",
                         worker_id, reason)
            self._send_deltas(self.health.retire(self.core, worker_id))
            self._send_all(self.links.on_worker_lost(worker_id))

    def _maybe_push_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_s < STATS_INTERVAL_S:
            return
        self._last_stats_s = now
        snap = self.health.snapshot(self.core)
        transport.send(self.outbox, SchedulerStats(
            time_s=time.time(), healthy=snap.healthy, stats=snap.stats, workers=snap.workers,
            problems=snap.problems, warnings=snap.warnings))

    def _stop_workers(self) -> None:
        for worker_id in self.readies:
            try:
                transport.send(self.workers, Shutdown("scheduler stopping"),
                               to=worker_identity(worker_id), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self.timeline.dump()
        self.health.close()
        self.admin.close()
        self.links.close()
        for sock in (self.inbox, self.outbox):
            sock.close(0)
        if self.core is not None and self.core.state.structured is not None:
            self.core.state.structured.compiler.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self.context.term()


def main() -> None:
    spec, stop = start_child()
    prepared = None
    if spec.extra.get("standby"):  # started ahead: load what takes long, then wait
        prepared = prepare_model(spec.model_path)
        num_restarts = wait_for_takeover(stop)
        if num_restarts is None:
            return
        spec = dataclasses.replace(spec, extra={**spec.extra, "num_restarts": num_restarts})
        logger.info("standby scheduler taking over (restart %d)", num_restarts)
    try:
        process = SchedulerProcess(spec, stop, prepared)
    except Exception as exc:  # e.g. the worker address is taken: one line, then exit
        report(spec, error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    try:
        process.wait_for_workers(spec.config.server.ready_timeout_s)
    except Exception as exc:  # report any start-up failure as one line, then exit
        report(spec, error=str(exc))
        process.close()
        raise SystemExit(1) from None
    report(spec, info={"num_workers": len(process.readies)})
    gc.freeze()  # start-up objects never die: keep full collections short in the loop
    try:
        process.run()
    finally:
        process.close()


if __name__ == "__main__":
    main()
