"""A worker placed by Ray on some host: Worker (workers/process.py), connected to the
scheduler over tcp:// with CURVE keys, reporting its host, and executing KV copies between
hosts (workers/kv/wire.py).

It runs inside a Ray actor process (justapi/cluster/actors.py starts it on a thread there):
Ray gives it a CPU share (its torch threads) or one GPU (then it is cuda:0, Ray having set
CUDA_VISIBLE_DEVICES). Its KV pool is its host's: the shared-memory segment of the host's
pool owner on CPU, its own device pool on a GPU.
Owns: the link settings and the extra message handling. Does not own: the loop (Worker).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from justapi.launch.child import ChildSpec, StopFlag
from justapi.wire import transport
from justapi.wire.protocol import BlocksCopied, ReadBlocks, Ready, WriteBlocks
from justapi.wire.worker_auth import connect_worker_socket
from workers.kv.wire import BlockWriter, read_blocks
from workers.model.attention import require_cuda
from workers.process import Worker


@dataclass(frozen=True)
class WorkerLink:
    """Where this worker runs and how it reaches the scheduler."""

    host: str  # this host's address (PoolInfo.host of its pool)
    secret_key: bytes  # this worker's own CURVE secret key (made in this process)
    server_public_key: bytes  # the scheduler's
    num_threads: int = 1  # torch threads on CPU (the Ray CPU share)


class RayWorker(Worker):
    def __init__(self, spec: ChildSpec, stop: StopFlag, link: WorkerLink) -> None:
        self.link = link
        super().__init__(spec, stop)
        self.writer = BlockWriter(self.pool, spec.index)

    def claim_device(self, spec: ChildSpec) -> str:
        if spec.config.model.device == "cuda":
            require_cuda("cuda:0")  # the one GPU Ray gave this actor
            return "cuda:0"
        torch.set_num_threads(max(1, self.link.num_threads))
        return "cpu"

    def connect(self, identity: bytes) -> zmq.Socket:
        return connect_worker_socket(self.context, self.spec.endpoints.workers, identity,
                                     self.link.secret_key, self.link.server_public_key)

    def ready_message(self) -> Ready:
        ready = super().ready_message()
        return dataclasses.replace(ready, pool=dataclasses.replace(ready.pool, host=self.link.host))

    def handle_other(self, message: Any) -> None:
        if isinstance(message, ReadBlocks):
            for chunk in read_blocks(self.pool, message, self.spec.index):
                transport.send(self.sock, chunk)
        elif isinstance(message, WriteBlocks):
            ack: BlocksCopied | None = self.writer.write(message)
            if ack is not None:
                transport.send(self.sock, ack)
        else:
            super().handle_other(message)
