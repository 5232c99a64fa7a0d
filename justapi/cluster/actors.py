"""The Ray actors of `justapi serve --launcher ray`: a worker, and a host's KV pool owner.

Ray's control plane is Ray's: it pickles actor arguments and return values. So everything
passed through it here is plain data (JSON text, str, int, float, dict of those) and never a
secret: a worker makes its CURVE key pair in its own process and hands out the public key
only. Our own traffic (plans, results, KV bytes) goes over the scheduler's CURVE socket with
the codec, never through Ray.

WorkerActor: __init__ (which Ray runs again when it restarts the actor after its process
died) makes the key pair and checks it runs on its node; start() (the launcher calls it once
the key is authorized) loads the model, maps the pool, connects and runs the worker loop on a
thread. HostPoolActor: creates its host's shared-memory KV segment, which every CPU worker on
that host maps; close() unlinks it, and if its process dies first Python's resource tracker
does (workers that mapped it keep their mapping).
This module imports no torch; the data plane (workers.process's Worker with a RayLink,
workers/link.py) is imported inside the actor's process, in start().
Owns: the actors' lifecycles. Does not own: placement (justapi/cluster/placement.py), the
worker loop (workers/), the segment's layout (justapi/launch/shm_pool.py).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import zmq

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.launch.child import ChildSpec, StopFlag
from justapi.launch.shm_pool import SharedPoolSegment, plan_cpu_pool
from justapi.model.info import ModelInfo

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


def this_node() -> tuple[str, str]:
    """(Ray node id, node IP) of the calling actor."""
    import ray  # only ever imported inside Ray's processes and the ray launcher

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _log_setup(role: str, level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr, force=True,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


class WorkerActor:
    def __init__(self, spec_json: str, node_id: str, server_public_key: str,
                 num_threads: int) -> None:
        self._spec = ChildSpec.from_json(spec_json)
        _log_setup(f"worker{self._spec.index}", self._spec.config.server.log_level)
        self.node_id, self.host = this_node()
        if node_id and self.node_id != node_id:  # Ray moved the slot to another node
            raise RuntimeError(f"worker {self._spec.index} belongs on node {node_id[:12]}, Ray "
                               f"started it on {self.node_id[:12]}: its host's KV pool is not here")
        public, self._secret_key = zmq.curve_keypair()
        self.public_key = public.decode()
        self._server_public_key = server_public_key.encode()
        self._num_threads = num_threads
        self._stop = StopFlag()
        self._done = threading.Event()
        self._worker: Any = None

    def identity(self) -> dict[str, Any]:
        """What the launcher needs before start(): the public key, the process, the host."""
        return {"public_key": self.public_key, "pid": os.getpid(), "host": self.host,
                "node_id": self.node_id}

    def start(self, pool: dict[str, Any]) -> dict[str, Any]:
        """Load, map `pool` (the host's segment; {} on a GPU), connect, run. Returns what the
        launcher shows; raises (one line) if the worker cannot start."""
        from workers.link import RayLink  # the data plane, in this process
        from workers.process import Worker

        spec = ChildSpec(role="worker", index=self._spec.index, config=self._spec.config,
                         endpoints=self._spec.endpoints, model_path=self._spec.model_path,
                         pool=pool, extra=self._spec.extra)
        link = RayLink(self.host, self._secret_key, self._server_public_key, self._num_threads)
        self._worker = Worker(spec, self._stop, link)
        threading.Thread(target=self._run, name="justapi-worker", daemon=True).start()
        return {"pid": os.getpid(), "host": self.host, "device": self._worker.device,
                "pool_id": self._worker.pool.pool_id,
                "pool_blocks": self._worker.pool.shape.num_blocks}

    def _run(self) -> None:
        try:
            self._worker.run()
        except BaseException:  # a worker that crashes dies, and Ray restarts it
            logger.exception("worker %d crashed", self._spec.index)
            os._exit(1)
        finally:
            self._worker.close()
            self._done.set()

    def wait_stopped(self) -> str:
        """Returns when the worker loop ended (Shutdown, stop()); fails if the process dies."""
        self._done.wait()
        return "stopped"

    def stop(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._done.wait(STOP_TIMEOUT_S)


class HostPoolActor:
    def __init__(self, config: dict[str, Any], model: dict[str, Any], pool_id: int) -> None:
        """Size (from this host's free memory unless pool-blocks is set) and create the segment."""
        cache, sched = CacheConfig(**config["cache"]), SchedulerConfig(**config["scheduler"])
        plan = plan_cpu_pool(ModelInfo(**model), cache, sched)
        self.pool_id = pool_id
        self.node_id, self.host = this_node()
        self.segment: SharedPoolSegment | None = SharedPoolSegment.create(plan)

    def describe(self) -> dict[str, Any]:
        """The segment as a worker's ChildSpec.pool: shm name, shape, pool id, host."""
        assert self.segment is not None, "describe() after close()"
        return {**self.segment.describe(), "pool_id": self.pool_id, "host": self.host}

    def close(self) -> None:
        if self.segment is not None:
            self.segment.unlink()
            self.segment = None
