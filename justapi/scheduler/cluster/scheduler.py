"""ClusterScheduler: Scheduler over KV pools on several hosts (launcher = "ray", colocated).

Each host has its own pool, so the router weighs a prefix cached on another host at its
blocks less the cost of copying them (cluster_router.py), and when a request lands in a pool
whose cache holds less of its prefix than another pool's, the scheduler orders that prefix
copied in (prefix_import.py) rather than recomputed: the request waits for the copy, then
queues as usual and its admission finds the blocks cached. A failed or abandoned copy costs
nothing but the recompute. Worker loss, preemption and the rule are Scheduler's.
Owns: the import orders and the public API around them. Does not own: the pieces it drives.
"""
from __future__ import annotations

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.config.spec import SpecConfig
from justapi.scheduler.cluster.hosts import HostMap
from justapi.scheduler.cluster.prefix_import import PrefixImporter
from justapi.scheduler.cluster.router import CostAwareRouter
from justapi.scheduler.deltas import DeltaBuilder
from justapi.scheduler.request import Request
from justapi.scheduler.scheduler import NOT_A_STEP, Scheduler, WorkerOrder
from justapi.scheduler.topology import ModelLimits, Topology
from justapi.scheduler.worker_state import WorkerState
from justapi.wire.protocol import (
    FINISH_ERROR,
    BlocksCopied,
    CopyBlocks,
    Ready,
    SubmitRequest,
    TokenDeltas,
)


class ClusterScheduler(Scheduler):
    """Scheduler with host-aware routing and prefix imports between pools."""

    router: CostAwareRouter

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, topology: Topology,
                 limits: ModelLimits, hosts: HostMap, spec: SpecConfig | None = None) -> None:
        super().__init__(config, cache, topology, limits, spec)
        self.hosts = hosts
        self.router = CostAwareRouter(self.state, hosts)
        self.importer = PrefixImporter(self.state, hosts)
        self._orders: list[tuple[int, CopyBlocks]] = []  # import copies not yet sent

    # ------------------------------------------------------------------ frontend side
    def add_request(self, request: SubmitRequest) -> None:
        super().add_request(request)
        req = self.state.requests[request.request_id]
        source = self.router.import_source(req, req.pool_id)
        if source is None:
            return
        started = self.importer.start(req, source)
        if started is None:
            return
        self.state.queues[req.pool_id].remove(req)  # held back until its prefix is copied
        del self.state.requests[req.request_id]
        self._orders.append(started)

    def abort_request(self, request_id: str) -> TokenDeltas | None:
        req = self.importer.abort(request_id)
        if req is not None:  # back in the state, so the core finishes it as usual
            self.state.requests[request_id] = req
            self.state.enqueue(req)
        return super().abort_request(request_id)

    # ------------------------------------------------------------------ worker side
    def schedule(self) -> list[tuple[int, WorkerOrder]]:
        """Import copies first (they may go to busy workers: they run after the step)."""
        orders: list[tuple[int, WorkerOrder]] = list(self._orders)
        self._orders.clear()
        return orders + super().schedule()

    def copy_done(self, ack: BlocksCopied) -> TokenDeltas:
        """A worker's answer to an import's CopyBlocks: its request queues again."""
        deltas = DeltaBuilder(NOT_A_STEP)
        req = self.importer.done(ack)
        if req is not None:
            self._requeue(req, deltas)
        return deltas.build()

    def tick(self, now_s: float) -> TokenDeltas | None:
        self.importer.now_s = float(now_s)
        return super().tick(now_s)

    def _lose_worker(self, worker: WorkerState, deltas: DeltaBuilder) -> None:
        lost = self.importer.copy_ids_of(worker.worker_id)
        super()._lose_worker(worker, deltas)
        self._orders = [(w, o) for w, o in self._orders if o.copy_id not in lost]
        for req in self.importer.on_worker_lost(worker):
            self._requeue(req, deltas)

    def _requeue(self, req: Request, deltas: DeltaBuilder) -> None:
        """A request whose import ended goes (back) to the best pool that can serve it now."""
        state = self.state
        state.requests[req.request_id] = req
        target = self.router.choose_pool(req)
        if target is None:
            state.enqueue(req)
            state.finish(req, FINISH_ERROR)
            state.counters.num_errors += 1
            deltas.add_error(req, FINISH_ERROR, f"no healthy worker can serve {req.request_id!r}")
            return
        state.place(req, target)
        state.enqueue(req)

    def add_worker(self, ready: Ready) -> None:
        super().add_worker(ready)
        self.hosts.add(ready.pool)

    # ------------------------------------------------------------------ introspection
    def has_work(self) -> bool:
        return super().has_work() or bool(self.importer.pending)

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out.update(self.importer.counters.as_stats(len(self.importer.pending)))
        out["num_hosts"] = len(self.hosts.hosts)
        return out
