"""When the Scheduler imports a prefix: the hooks it calls with pools on several hosts.

Each host has its own pool, so when a request lands in a pool whose cache holds less of its
prefix than another pool's (the Router says where from: `import_source`), the prefix is
copied in (prefix_import.py) rather than recomputed: the request is held back while its copy
runs, then queues as usual and its admission finds the blocks cached. A failed or abandoned
copy costs nothing but the recompute. On one host the Scheduler is given NoImports, whose
hooks do nothing.
Owns: the import orders not yet sent and the requests held back. Does not own: the copy's
blocks (PrefixImporter), the pool choice (Router), the rule (Scheduler).
"""
from __future__ import annotations

from justapi.scheduler.cluster.hosts import HostMap
from justapi.scheduler.cluster.prefix_import import PrefixImporter
from justapi.scheduler.deltas import DeltaBuilder
from justapi.scheduler.request import Request
from justapi.scheduler.router import Router
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.worker_state import WorkerState
from justapi.wire.protocol import FINISH_ERROR, BlocksCopied, CopyBlocks, PoolInfo


class NoImports:
    """One host: no prefix is ever copied between pools."""

    def on_added(self, req: Request) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass

    def take_orders(self) -> list[tuple[int, CopyBlocks]]:
        return []

    def on_copied(self, ack: BlocksCopied, deltas: DeltaBuilder) -> None:
        pass

    def on_tick(self, now_s: float) -> None:
        pass

    def on_worker_lost(self, worker: WorkerState, deltas: DeltaBuilder) -> None:
        pass

    def add_pool(self, info: PoolInfo) -> None:
        pass

    def has_work(self) -> bool:
        return False

    def stats(self) -> dict[str, float]:
        return {}


class PrefixImports:
    """Prefix imports between pools on several hosts (launcher = "ray", colocated)."""

    def __init__(self, state: SchedulerState, router: Router, hosts: HostMap) -> None:
        self.state = state
        self.router = router
        self.hosts = hosts
        self.importer = PrefixImporter(state, hosts)
        self._orders: list[tuple[int, CopyBlocks]] = []  # import copies not yet sent

    def on_added(self, req: Request) -> None:
        """A request was queued in its pool: import its prefix there if that beats compute."""
        source = self.router.import_source(req, req.pool_id)
        if source is None:
            return
        started = self.importer.start(req, source)
        if started is None:
            return
        self.state.queues[req.pool_id].remove(req)  # held back until its prefix is copied
        del self.state.requests[req.request_id]
        self._orders.append(started)

    def on_abort(self, request_id: str) -> None:
        """A request leaving during its import goes back in the state, so the core finishes
        it as usual (the copy completes without it)."""
        req = self.importer.abort(request_id)
        if req is not None:
            self.state.requests[request_id] = req
            self.state.enqueue(req)

    def take_orders(self) -> list[tuple[int, CopyBlocks]]:
        """Import copies to send (before the step plans: they may go to busy workers)."""
        orders, self._orders = self._orders, []
        return orders

    def on_copied(self, ack: BlocksCopied, deltas: DeltaBuilder) -> None:
        """A worker's answer to an import's CopyBlocks: its request queues again."""
        req = self.importer.done(ack)
        if req is not None:
            self._requeue(req, deltas)

    def on_tick(self, now_s: float) -> None:
        self.importer.now_s = float(now_s)

    def on_worker_lost(self, worker: WorkerState, deltas: DeltaBuilder) -> None:
        """After the core gave the worker up: its copies are dropped, their requests
        re-routed among the pools still healthy."""
        lost = self.importer.copy_ids_of(worker.worker_id)
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

    def add_pool(self, info: PoolInfo) -> None:
        """A worker (re)joined: where its pool lives."""
        self.hosts.add(info)

    def has_work(self) -> bool:
        return bool(self.importer.pending)

    def stats(self) -> dict[str, float]:
        out = self.importer.counters.as_stats(len(self.importer.pending))
        out["num_hosts"] = len(self.hosts.hosts)
        return out
