"""The scheduler process when workers run on other hosts (launcher = "ray"): SchedulerProcess
with the worker socket on tcp:// (CURVE, ZAP-authorized keys: justapi/wire/worker_auth.py),
host-aware health (justapi/health/cluster.py) and the relay of KV copies between hosts.

A copy order (a PD hand-off, or a prefix import of ClusterScheduler) whose destination
worker cannot map the source pool goes through the relay (justapi/cluster/kv_relay.py): ReadBlocks
to a healthy worker of the source pool, its BlockData chunks forwarded to the destination as
WriteBlocks, whose BlocksCopied reaches the core as usual. Losing the reading worker fails
the copy at its destination (the core then recomputes or fails the request).
Owns: the worker endpoint's security, the relay's sockets side, fence orders to the
launcher. Does not own: scheduling (the core), verdicts (HealthWatch), Ray (the launcher).
"""
from __future__ import annotations

import gc
import logging
from typing import Any

import numpy as np
import zmq

from justapi.cluster.kv_relay import KvRelay, needs_relay
from justapi.health.cluster import ClusterHealthWatch
from justapi.launch.child import ChildSpec, StopFlag, report, start_child
from justapi.scheduler.process import SchedulerProcess, worker_identity
from justapi.wire import transport
from justapi.wire.protocol import BlockData, CopyBlocks, FenceWorker, WriteBlocks
from justapi.wire.worker_auth import WorkerAuthenticator, bind_worker_socket, read_key_file

logger = logging.getLogger(__name__)


class ClusterSchedulerProcess(SchedulerProcess):
    def __init__(self, spec: ChildSpec, stop: StopFlag) -> None:
        self.authenticator: WorkerAuthenticator | None = None
        super().__init__(spec, stop)
        self.to_launcher = transport.make_socket(self.context, zmq.PUSH, spec.endpoints.control,
                                                 bind=False)
        self.health = ClusterHealthWatch(spec.config.ops, str(spec.extra.get("host", "")),
                                         self._fence_remote)
        self.relay = KvRelay()

    def open_worker_socket(self, context: zmq.Context) -> zmq.Socket:
        curve = self.spec.extra["worker_curve"]
        secret_key = read_key_file(curve["secret_key_file"])
        sock, self.authenticator = bind_worker_socket(
            context, self.spec.endpoints.workers, secret_key, curve["authorized_keys_file"])
        logger.info("workers connect to %s (CURVE, keys authorized by the launcher)",
                    self.spec.endpoints.workers)
        return sock

    def _fence_remote(self, worker_id: int, pid: int, reason: str) -> None:
        """Ask the launcher to kill a worker process on another host (through Ray)."""
        try:
            transport.send(self.to_launcher, FenceWorker(worker_id, pid, reason), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.error("cannot ask the launcher to fence worker %d: %s", worker_id, exc)

    # ---------------------------------------------------------------- KV copies between hosts
    def _send_plan(self, worker_id: int, plan: Any) -> None:
        if isinstance(plan, CopyBlocks):
            ready = self.readies.get(worker_id)
            if ready is not None and needs_relay(plan, ready.pool):
                self._relay_copy(worker_id, plan)
                return
        super()._send_plan(worker_id, plan)

    def _relay_copy(self, dst_worker: int, order: CopyBlocks) -> None:
        source = self._source_worker(order.src_pool)
        if source is None:  # the destination answers the error (the core then recomputes)
            self._send(dst_worker, WriteBlocks(
                order.copy_id, np.zeros(0, np.int32), "", np.zeros(0, np.uint8), True,
                f"no healthy worker on the host of pool {order.src_pool} can read its blocks"))
            return
        self._send(source, self.relay.start(order, dst_worker, source))

    def _source_worker(self, pool_id: int) -> int | None:
        """A healthy worker mapping the pool (the least recently busy is not tracked: any)."""
        monitor = self.health.monitor.workers
        healthy = [w for w, ready in self.readies.items() if ready.pool.pool_id == pool_id
                   and w in monitor and monitor[w].is_healthy]
        return min(healthy, default=None)

    def _send(self, worker_id: int, message: Any) -> None:
        super()._send_plan(worker_id, message)  # (records steps only for StepPlans)

    def _on_worker(self, sender: bytes | None, message: Any) -> None:
        if not isinstance(message, BlockData):
            super()._on_worker(sender, message)
            return
        if sender != worker_identity(message.worker_id):
            logger.warning("dropped BlockData from %r: not worker %d's socket", sender,
                           message.worker_id)
            return
        forwarded = self.relay.forward(message)
        if forwarded is not None:
            self._send(*forwarded)

    def _check_health(self) -> None:
        for worker_id, reason in self.health.poll():
            logger.error("worker %d is unhealthy: %s; fencing it, re-queueing its requests",
                         worker_id, reason)
            self._send_deltas(self.health.retire(self.core, worker_id))
            for dst_worker, failed in self.relay.on_worker_lost(worker_id):
                self._send(dst_worker, failed)

    def close(self) -> None:
        self.to_launcher.close(0)
        if self.authenticator is not None:
            self.authenticator.stop()
        super().close()


def main() -> None:
    spec, stop = start_child()
    try:
        process = ClusterSchedulerProcess(spec, stop)
    except Exception as exc:  # e.g. the worker address is taken: one line, then exit
        report(spec, error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    try:
        process.wait_for_workers(spec.config.server.ready_timeout_s)
    except Exception as exc:
        report(spec, error=str(exc))
        process.close()
        raise SystemExit(1) from None
    report(spec, info={"num_workers": len(process.readies)})
    gc.freeze()
    try:
        process.run()
    finally:
        process.close()


if __name__ == "__main__":
    main()
