"""The scheduler process's links to workers on other hosts (launcher = "ray"), the
WorkerLinks it opens when its spec carries the worker endpoint's CURVE files.

The worker socket is tcp:// with CURVE, only keys the launcher authorized getting in
(justapi/wire/auth.py). A copy order (a PD hand-off, or a prefix import) whose destination
worker cannot map the source pool goes through the relay (kv_relay.py): ReadBlocks to a
healthy worker of the source pool, its BlockData chunks forwarded to the destination as
WriteBlocks, whose BlocksCopied reaches the core as usual. Losing the reading worker fails
the copy at its destination (the core then recomputes or fails the request). Health is
host-aware (justapi/health/cluster.py); a worker on another host is fenced by an order to
the launcher (FenceWorker on its control socket), which has Ray kill it.
Owns: the worker endpoint's security, the relay's routing, fence orders to the launcher.
Does not own: scheduling (the core), verdicts (HealthWatch), Ray (the launcher).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import zmq

from justapi.cluster.kv_relay import KvRelay, needs_relay
from justapi.health.cluster import HostHealth
from justapi.launch.child import ChildSpec
from justapi.wire import transport
from justapi.wire.auth import bind_worker_socket, read_key_file
from justapi.wire.protocol import BlockData, CopyBlocks, FenceWorker, Ready, WriteBlocks

logger = logging.getLogger(__name__)

Send = tuple[int, Any]  # (worker id, message) for the scheduler process to send


class ClusterLinks:
    def __init__(self, context: zmq.Context, spec: ChildSpec, readies: Mapping[int, Ready],
                 is_healthy: Callable[[int], bool]) -> None:
        """readies: the process's worker -> Ready table (live); is_healthy: its verdicts."""
        curve = spec.extra["worker_curve"]
        self.socket, self.authenticator = bind_worker_socket(
            context, spec.endpoints.workers, read_key_file(curve["secret_key_file"]),
            curve["authorized_keys_file"])
        logger.info("workers connect to %s (CURVE, keys authorized by the launcher)",
                    spec.endpoints.workers)
        self.to_launcher = transport.make_socket(context, zmq.PUSH, spec.endpoints.control,
                                                 bind=False)
        self.hosts = HostHealth(str(spec.extra.get("host", "")), self.fence_remote)
        self.relay = KvRelay()
        self._readies = readies
        self._is_healthy = is_healthy

    def fence_remote(self, worker_id: int, pid: int, reason: str) -> None:
        """Ask the launcher to kill a worker process on another host (through Ray)."""
        try:
            transport.send(self.to_launcher, FenceWorker(worker_id, pid, reason),
                           flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.error("cannot ask the launcher to fence worker %d: %s", worker_id, exc)

    # ---------------------------------------------------------------- KV copies between hosts
    def route(self, worker_id: int, order: Any) -> list[Send]:
        """A copy the destination cannot map goes through the relay; anything else as is."""
        if isinstance(order, CopyBlocks):
            ready = self._readies.get(worker_id)
            if ready is not None and needs_relay(order, ready.pool):
                return [self._relay_copy(worker_id, order)]
        return [(worker_id, order)]

    def _relay_copy(self, dst_worker: int, order: CopyBlocks) -> Send:
        source = self._source_worker(order.src_pool)
        if source is None:  # the destination answers the error (the core then recomputes)
            return dst_worker, WriteBlocks(
                order.copy_id, np.zeros(0, np.int32), "", np.zeros(0, np.uint8), True,
                f"no healthy worker on the host of pool {order.src_pool} can read its blocks")
        return source, self.relay.start(order, dst_worker, source)

    def _source_worker(self, pool_id: int) -> int | None:
        """A healthy worker mapping the pool (the least recently busy is not tracked: any)."""
        healthy = [w for w, ready in self._readies.items()
                   if ready.pool.pool_id == pool_id and self._is_healthy(w)]
        return min(healthy, default=None)

    def forward(self, chunk: BlockData) -> list[Send]:
        """A source worker's chunk (its sender checked) -> the destination's WriteBlocks."""
        forwarded = self.relay.forward(chunk)
        return [forwarded] if forwarded is not None else []

    def on_worker_lost(self, worker_id: int) -> list[Send]:
        """Copies the lost worker was reading fail at their destinations."""
        return list(self.relay.on_worker_lost(worker_id))

    def close(self) -> None:
        self.to_launcher.close(0)
        self.authenticator.stop()
        self.socket.close(0)
