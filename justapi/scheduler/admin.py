"""The scheduler's admin socket: status, drain/undrain, prefix-cache flush, invariant check.

A ROUTER socket (ipc in the runtime dir unless `admin` names a loopback tcp endpoint);
every request from the ops commands (justapi/ops/admin_client.py) gets exactly one reply, a
StatusReply or an AdminReply, built between steps by the scheduler's own thread, so
commands see and change the core's state without locks. Bad input (an unknown worker or
pool) is an AdminReply with ok=False naming the value.
Owns: the admin socket and the meaning of each command. Does not own: the state they read
or change (scheduler core, health watch).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from justapi.health.watch import HealthWatch
from justapi.wire import transport
from justapi.wire.protocol import (
    AdminReply,
    CheckInvariants,
    DrainWorker,
    FlushPrefixCache,
    QueryStatus,
    StatusReply,
)

logger = logging.getLogger(__name__)


class AdminServer:
    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.endpoint = endpoint
        self.socket = transport.make_socket(context, zmq.ROUTER, endpoint, bind=True)

    def serve(self, core: Any, health: HealthWatch) -> None:
        """Answer every request waiting on the socket (non-blocking)."""
        for sender, message in transport.drain(self.socket, routed=True, limit=64):
            reply = handle_admin(core, health, message)
            try:
                transport.send(self.socket, reply, to=sender, flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # the tool gave up and left: nobody to answer
                logger.debug("admin client %r left before its reply", sender)

    def close(self) -> None:
        self.socket.close(0)


def handle_admin(core: Any, health: HealthWatch, message: Any) -> StatusReply | AdminReply:
    if isinstance(message, QueryStatus):
        return status_reply(core, health)
    try:
        if isinstance(message, DrainWorker):
            return _drain(core, message)
        if isinstance(message, FlushPrefixCache):
            return _flush(core, message)
        if isinstance(message, CheckInvariants):
            return _check(core)
    except ValueError as exc:
        return AdminReply(ok=False, message=str(exc))
    return AdminReply(ok=False, message=f"unknown admin command {type(message).__name__}")


def status_reply(core: Any, health: HealthWatch) -> StatusReply:
    snap = health.snapshot(core)
    return StatusReply(time_s=time.time(), uptime_s=snap.uptime_s, healthy=snap.healthy,
                       problems=snap.problems, warnings=snap.warnings, stats=snap.stats,
                       workers=snap.workers, gpus=snap.gpus, nvml=snap.nvml)


def _drain(core: Any, message: DrainWorker) -> AdminReply:
    worker_id = message.worker_id
    if not isinstance(worker_id, int) or isinstance(worker_id, bool):
        raise ValueError(f"worker_id must be an integer, got {worker_id!r}")
    num_running = core.set_draining(worker_id, bool(message.is_draining))
    verb = "draining" if message.is_draining else "accepting new requests"
    logger.info("admin: worker %d is %s (%d requests running)", worker_id, verb, num_running)
    return AdminReply(ok=True, message=f"worker {worker_id}: {verb} ({num_running} request(s) "
                                       "running)",
                      figures={"worker_id": worker_id, "is_draining": bool(message.is_draining),
                               "num_requests_running": num_running})


def _flush(core: Any, message: FlushPrefixCache) -> AdminReply:
    pool_id = message.pool_id
    if not isinstance(pool_id, int) or isinstance(pool_id, bool) or pool_id < -1:
        raise ValueError(f"pool_id must be -1 (every pool) or a pool id, got {pool_id!r}")
    freed = core.flush_prefix_cache(None if pool_id == -1 else pool_id)
    left = int(core.stats().get("prefix_cache_blocks", 0))
    where = "every pool" if pool_id == -1 else f"pool {pool_id}"
    logger.info("admin: flushed %d prefix-cache blocks in %s", freed, where)
    return AdminReply(ok=True, message=f"flushed {freed} unreferenced prefix-cache block(s) in "
                                       f"{where}; {left} cached block(s) left, held by running "
                                       "requests",
                      figures={"num_blocks_freed": freed, "prefix_cache_blocks": left})


def _check(core: Any) -> AdminReply:
    stats = core.stats()
    try:
        core.check_invariants()
    except AssertionError as exc:
        logger.error("admin: scheduler invariant violated: %s", exc)
        return AdminReply(ok=False, message=f"invariant violated: {exc}")
    return AdminReply(ok=True, message=f"invariants hold ({int(stats['kv_blocks_total'])} blocks, "
                                       f"{int(stats['num_requests_running'])} running, "
                                       f"{int(stats['num_requests_waiting'])} waiting)",
                      figures={k: stats[k] for k in ("kv_blocks_total", "kv_blocks_in_use",
                                                     "kv_blocks_free", "prefix_cache_blocks")})
