"""Where the workers run: the strategy the Launcher is given (launcher = local | ray).

LocalPlacement (here): every worker is a `python -m workers.process` child of the launcher
on this host; on CPU they map one shared-memory KV pool (or one per PD side) that this
placement creates and, once every process has stopped, unlinks (even when a worker was
SIGKILLed). RayPlacement (justapi/cluster/placement.py): workers are Ray actors on the
cluster's nodes, with a pool owner per host and CURVE keys for the worker endpoint.
Owns: the Placement protocol, LocalPlacement's pool. Does not own: the frontend and the
scheduler, which always run here as the launcher's children (launcher.py).
"""
from __future__ import annotations

from typing import Any, Protocol

from justapi.config.serve import ServeConfig
from justapi.launch.child import Endpoints
from justapi.launch.shm_pool import PoolSegments, plan_cpu_pool, sweep_stale_segments
from justapi.model.info import ModelInfo
from justapi.wire.protocol import FenceWorker


class Placement(Protocol):
    def open(self, endpoints: Endpoints) -> Endpoints:
        """Before anything starts: the deployment's endpoints as the workers need them."""

    def place_workers(self) -> dict[str, Any]:
        """Make the KV pools (and start any workers that are not the launcher's children);
        the pools as the banner shows them."""

    def local_workers(self) -> list[int]:
        """The indices of the workers the launcher starts as its own children."""

    def worker_pool(self, index: int) -> dict[str, Any]:
        """ChildSpec.pool of local worker `index` ({}: it allocates its own)."""

    def scheduler_extra(self) -> dict[str, Any]:
        """What the scheduler's ChildSpec.extra carries about how to reach the workers."""

    def check(self, *, starting: bool) -> None:
        """Look after the workers that are not the launcher's children; while starting,
        raise LaunchError (one line) for one that failed."""

    def fence(self, order: FenceWorker) -> None:
        """The scheduler's order to kill a worker it cannot signal itself."""

    def close(self) -> None:
        """After the launcher's children stopped: stop the other workers, free the pools."""


class LocalPlacement:
    """Every worker a child process of the launcher, on this host."""

    def __init__(self, config: ServeConfig, model: ModelInfo) -> None:
        self.config = config
        self.model = model
        self.segment: PoolSegments | None = None

    def open(self, endpoints: Endpoints) -> Endpoints:
        return endpoints

    def place_workers(self) -> dict[str, Any]:
        if self.config.model.device != "cpu":
            return {}
        config = self.config
        sweep_stale_segments()  # what a killed server left, before /dev/shm's free space is read
        plan = plan_cpu_pool(self.model, config.cache, config.scheduler,
                             num_workers=config.server.workers,
                             num_pools=2 if config.pd.pd_separate_pools else 1)
        self.segment = PoolSegments.create(plan, self.config.pd)  # one, or one per PD side
        return self.segment.describe()

    def local_workers(self) -> list[int]:
        return list(range(self.config.server.workers))

    def worker_pool(self, index: int) -> dict[str, Any]:
        # --pd-separate-pools: its side's segment
        return self.segment.for_worker(index) if self.segment is not None else {}

    def scheduler_extra(self) -> dict[str, Any]:
        return {}

    def check(self, *, starting: bool) -> None:
        """Nothing: local workers are the launcher's children (its supervisor's)."""

    def fence(self, order: FenceWorker) -> None:
        """Nothing: the scheduler signals a worker on its own host itself."""

    def close(self) -> None:
        if self.segment is not None:
            self.segment.unlink()
            self.segment = None
