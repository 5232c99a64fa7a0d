"""How the scheduler process reaches its workers, chosen at start-up from its spec.

LocalLinks: every worker runs on this host (launcher = "local"): an ipc ROUTER in the
runtime dir; every pool a worker copies from is one it maps itself, so orders go as they
are; /proc and SIGKILL reach every worker (health's OneHost). ClusterLinks
(justapi/cluster/links.py): workers on other hosts (launcher = "ray", whose spec carries the
worker endpoint's CURVE files): tcp with CURVE, KV copies between hosts relayed, host-aware
health with fences through the launcher.
Owns: the choice, and LocalLinks. Does not own: what is sent when (SchedulerProcess).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import zmq

from justapi.cluster.links import ClusterLinks
from justapi.health.watch import HostTable, OneHost
from justapi.launch.child import ChildSpec
from justapi.wire import transport
from justapi.wire.protocol import BlockData, Ready

logger = logging.getLogger(__name__)


class WorkerLinks(Protocol):
    @property
    def socket(self) -> zmq.Socket:
        """The ROUTER the workers connect to."""

    @property
    def hosts(self) -> HostTable:
        """For HealthWatch: which workers are local, how to fence the others."""

    def route(self, worker_id: int, order: Any) -> list[tuple[int, Any]]:
        """What to send to whom so that worker_id gets order done."""

    def forward(self, chunk: BlockData) -> list[tuple[int, Any]]:
        """Where a relayed copy's chunk goes next."""

    def on_worker_lost(self, worker_id: int) -> list[tuple[int, Any]]:
        """What to tell other workers about a retired one (copies it was reading)."""

    def close(self) -> None: ...


class LocalLinks:
    """Workers on this host: an ipc ROUTER; orders go straight to their worker."""

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.socket = transport.make_socket(context, zmq.ROUTER, endpoint, bind=True)
        self.hosts = OneHost()

    def route(self, worker_id: int, order: Any) -> list[tuple[int, Any]]:
        return [(worker_id, order)]

    def forward(self, chunk: BlockData) -> list[tuple[int, Any]]:
        logger.warning("ignored unexpected BlockData from worker %d", chunk.worker_id)
        return []

    def on_worker_lost(self, worker_id: int) -> list[tuple[int, Any]]:
        return []

    def close(self) -> None:
        self.socket.close(0)


def open_links(context: zmq.Context, spec: ChildSpec, readies: Mapping[int, Ready],
               is_healthy: Callable[[int], bool]) -> WorkerLinks:
    """ClusterLinks when the launcher handed over CURVE files for the worker endpoint (launcher
    = "ray"), else LocalLinks. readies and is_healthy: the process's (the relay's sources)."""
    if "worker_curve" in spec.extra:
        return ClusterLinks(context, spec, readies, is_healthy)
    return LocalLinks(context, spec.endpoints.workers)
