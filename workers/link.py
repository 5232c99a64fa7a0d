"""Where a worker runs and how it reaches the scheduler: the link passed to Worker.

LocalLink: a process the launcher started on the scheduler's host (`python -m
workers.process`): its device by index (cuda:N) or its share of the cores, a plain DEALER on
the ipc endpoint. RayLink: a worker Ray placed on some host (justapi/cluster/actors.py runs
it on a thread of its actor): the one GPU Ray gave it (cuda:0, Ray having set
CUDA_VISIBLE_DEVICES) or its Ray CPU share, tcp with CURVE keys (its own pair, made in its
process), its host named in its pool's PoolInfo, and KV copies between hosts
(workers/kv/wire.py). Its pool is its host's: the host's shared segment on CPU, its own on a GPU.
Owns: device claims, socket set-up, the host report. Does not own: the loop (process.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import zmq

from justapi.launch.child import ChildSpec
from justapi.wire import transport
from justapi.wire.auth import connect_worker_socket
from workers.cpu_memory import keep_freed_memory
from workers.kv.pool import KVPool
from workers.kv.wire import WireCopies
from workers.model.attention import require_cuda


class WorkerLink(Protocol):
    @property
    def host(self) -> str:
        """The address of the host this worker runs on ("": the launcher's)."""

    def claim_device(self, spec: ChildSpec) -> str:
        """The device this worker computes on (claiming its threads or GPU)."""

    def connect(self, context: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
        """A DEALER to the scheduler's worker endpoint under `identity`."""

    def wire_copies(self, pool: KVPool, worker_id: int) -> WireCopies | None:
        """The handler of relayed copies (ReadBlocks, WriteBlocks), if any reach this worker."""


class LocalLink:
    """A worker process on the scheduler's host (launcher = "local")."""

    host = ""  # PoolInfo.host of the launcher's own host

    def claim_device(self, spec: ChildSpec) -> str:
        """The device this worker computes on; on CPU also its share of the cores."""
        device = device_of(spec)
        if device != "cpu":
            require_cuda(device)
        else:
            set_cpu_threads(spec)
            keep_freed_memory()
        return device

    def connect(self, context: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
        return transport.make_socket(context, zmq.DEALER, endpoint, bind=False,
                                     identity=identity)

    def wire_copies(self, pool: KVPool, worker_id: int) -> WireCopies | None:
        """None: every pool this worker copies from is one it maps (CopyBlocks)."""
        return None


@dataclass(frozen=True)
class RayLink:
    """A worker Ray placed on some host (launcher = "ray")."""

    host: str  # this host's address (PoolInfo.host of its pool)
    secret_key: bytes  # this worker's own CURVE secret key (made in this process)
    server_public_key: bytes  # the scheduler's
    num_threads: int = 1  # torch threads on CPU (the Ray CPU share)

    def claim_device(self, spec: ChildSpec) -> str:
        if spec.config.model.device == "cuda":
            require_cuda("cuda:0")  # the one GPU Ray gave this actor
            return "cuda:0"
        torch.set_num_threads(max(1, self.num_threads))
        return "cpu"

    def connect(self, context: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
        return connect_worker_socket(context, endpoint, identity, self.secret_key,
                                     self.server_public_key)

    def wire_copies(self, pool: KVPool, worker_id: int) -> WireCopies:
        """Copies from pools on other hosts arrive relayed, as bytes (ReadBlocks/WriteBlocks)."""
        return WireCopies(pool, worker_id)


def device_of(spec: ChildSpec) -> str:
    return f"cuda:{spec.index}" if spec.config.model.device == "cuda" else "cpu"


def set_cpu_threads(spec: ChildSpec) -> int:
    """Each CPU worker gets its share of the cores (ServeConfig.cpu_worker_threads)."""
    num_workers = int(spec.extra.get("num_workers", spec.config.server.workers))
    threads = spec.config.cpu_worker_threads(spec.index, num_workers, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads
