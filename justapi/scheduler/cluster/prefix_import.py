"""Prefix imports: copy a request's cached prefix from another pool (another host) into the
pool it was routed to, instead of recomputing it.

    start(req, source)  the source pool's cached prefix and the destination's own cached part
                        are held under the copy's holder, fresh destination blocks reserved
                        for the rest; CopyBlocks to a worker of the destination pool
    done(ack)           the copied blocks join the destination's prefix cache (then nobody
                        holds them: the request's admission matches them like any cached
                        prefix); on an error nothing is cached and the request recomputes
    on_worker_lost(w)   copies w was making are given up (the request recomputes)
    abort(req)          the request leaves; the copy finishes and is cached anyway

An import is a HandOff record with no request (PD's orphan shape, handoff.py), kept in the
state's hand-off table, so the holdings count in the block invariants like PD copies do.
While it is in flight its request is held back from the queue (not in `state.requests`).
Owns: the pending imports and their counters. Does not own: the routing choice
(justapi/scheduler/router.py) or when these run (imports.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from justapi.scheduler.cluster.hosts import HostMap
from justapi.scheduler.pd.handoff_table import HandOff
from justapi.scheduler.request import Request
from justapi.scheduler.router import PrefixSource
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.worker_state import WorkerState
from justapi.wire.protocol import BlocksCopied, CopyBlocks


@dataclass(eq=False)
class PendingImport:
    req: Request | None  # None once aborted: the copy still holds its blocks until the ack
    handoff: HandOff
    tokens: bytes  # the request's tokens and salt: the radix key of the copied blocks
    salt: str


@dataclass
class ImportCounters:
    num_imports: int = 0
    num_import_failures: int = 0
    import_blocks: int = 0
    import_bytes: int = 0

    def as_stats(self, num_in_flight: int) -> dict[str, float]:
        return {"kv_imports": self.num_imports, "kv_import_failures": self.num_import_failures,
                "kv_import_blocks": self.import_blocks, "kv_import_bytes": self.import_bytes,
                "kv_imports_in_flight": num_in_flight}


class PrefixImporter:
    def __init__(self, state: SchedulerState, hosts: HostMap) -> None:
        self.state = state
        self.kv = state.kv
        self.hosts = hosts
        self.pending: dict[int, PendingImport] = {}  # copy id ->
        self.by_request: dict[str, int] = {}  # request id -> copy id (live requests only)
        self.counters = ImportCounters()
        self.now_s = 0.0

    def start(self, req: Request, source: PrefixSource) -> tuple[int, CopyBlocks] | None:
        """Reserve and order the copy of source's extra blocks into req's pool; None (and no
        change) when the pool has no idle room for it or no healthy worker to copy."""
        dst, src = req.pool_id, source.pool_id
        worker = self._copy_worker(dst)
        if worker is None or self.state.reservations[dst] is not None:
            return None  # a running request waits for this pool's free blocks: leave them
        handoff = HandOff(None, src, dst, self.now_s, source.num_blocks)
        self.state.handoffs.start_copy(handoff)
        if not self._reserve(handoff, req, source.num_blocks):
            self.state.handoffs.end_copy(handoff.copy_id)
            return None
        handoff.worker_id = worker.worker_id
        self.pending[handoff.copy_id] = PendingImport(req, handoff, req.token_bytes(),
                                                      req.cache_salt)
        self.by_request[req.request_id] = handoff.copy_id
        order = self._order(handoff)
        counters = self.counters
        counters.num_imports += 1
        counters.import_blocks += len(order.dst_block_ids)
        counters.import_bytes += len(order.dst_block_ids) * self.hosts.block_bytes(src)
        return worker.worker_id, order

    def _reserve(self, handoff: HandOff, req: Request, num_blocks: int) -> bool:
        """Hold the source's prefix and the destination's cached part, allocate the rest."""
        kv, holder = self.kv, handoff.holder
        tokens, salt = req.token_bytes(), req.cache_salt
        local = kv.hold_prefix(handoff.dst_pool_id, tokens, salt, num_blocks, holder)
        source = kv.hold_prefix(handoff.src_pool_id, tokens, salt, num_blocks, holder)
        handoff.dst_block_ids, handoff.dst_node = list(local.block_ids), local.node
        handoff.num_dst_cached = local.num_blocks
        handoff.src_block_ids, handoff.src_node = list(source.block_ids), source.node
        need = source.num_blocks - local.num_blocks
        fresh = (self.kv.allocate_blocks(handoff.dst_pool_id, need, holder) if need > 0
                 else None)
        if fresh is None:
            self._release(handoff)
            return False
        handoff.dst_block_ids += fresh
        handoff.num_blocks = source.num_blocks
        return True

    def _order(self, handoff: HandOff) -> CopyBlocks:
        """Blocks [num_dst_cached, num_blocks) of the source prefix -> the fresh blocks."""
        pool, first = self.state.pool, handoff.num_dst_cached
        src_ids = np.asarray(handoff.src_block_ids[first:], dtype=np.int32)
        dst_ids = np.asarray(handoff.dst_block_ids[first:], dtype=np.int32)
        return CopyBlocks(copy_id=handoff.copy_id, src_pool=handoff.src_pool_id,
                          src_block_ids=src_ids - np.int32(pool.base(handoff.src_pool_id)),
                          dst_block_ids=dst_ids - np.int32(pool.base(handoff.dst_pool_id)),
                          src=self.hosts.pools.get(handoff.src_pool_id))

    def _copy_worker(self, pool_id: int) -> WorkerState | None:
        workers = self.state.healthy_workers(pool_id)
        return min(workers, key=lambda w: (len(w.running), w.worker_id), default=None)

    # ------------------------------------------------------------------ outcomes
    def done(self, ack: BlocksCopied) -> Request | None:
        """A copy finished (or failed): cache its blocks; the request to queue again, if any."""
        entry = self.pending.get(ack.copy_id)
        if entry is None or ack.worker_id != entry.handoff.worker_id:
            return None  # given up with its worker, or not that worker's order
        self._forget(entry)
        if ack.error:
            self.counters.num_import_failures += 1
            self._release(entry.handoff)
        else:
            self._cache(entry)
        return entry.req

    def on_worker_lost(self, worker: WorkerState) -> list[Request]:
        """Give up the copies the worker was making (it writes no more); their requests."""
        lost = [e for e in self.pending.values() if e.handoff.worker_id == worker.worker_id]
        for entry in lost:
            self._forget(entry)
            self._release(entry.handoff)
        return [entry.req for entry in lost if entry.req is not None]

    def abort(self, request_id: str) -> Request | None:
        """The request leaves its import (which completes without it); None if it had none."""
        copy_id = self.by_request.pop(request_id, None)
        if copy_id is None:
            return None
        entry = self.pending[copy_id]
        req, entry.req = entry.req, None
        return req

    def copy_ids_of(self, worker_id: int) -> set[int]:
        return {c for c, e in self.pending.items() if e.handoff.worker_id == worker_id}

    def _forget(self, entry: PendingImport) -> None:
        handoff = entry.handoff
        del self.pending[handoff.copy_id]
        self.state.handoffs.end_copy(handoff.copy_id)
        if entry.req is not None:
            self.by_request.pop(entry.req.request_id, None)

    def _cache(self, entry: PendingImport) -> None:
        """Insert the destination blocks into its prefix cache, then let every block go."""
        handoff = entry.handoff
        cache = self.kv.caches[handoff.dst_pool_id]
        if self.kv.enable_prefix_cache:
            insertion = cache.insert(entry.tokens, handoff.dst_block_ids, entry.salt,
                                     handoff.holder, start=handoff.dst_node)
            if insertion.node is not None:
                handoff.dst_node = insertion.node  # deepest node of what the holder holds
        self._release(handoff)

    def _release(self, handoff: HandOff) -> None:
        kv, holder = self.kv, handoff.holder
        if handoff.dst_block_ids:
            kv.release(handoff.dst_pool_id, handoff.dst_block_ids, handoff.dst_node, holder)
        if handoff.src_block_ids:
            kv.release(handoff.src_pool_id, handoff.src_block_ids, handoff.src_node, holder)
        handoff.dst_block_ids, handoff.dst_node = [], None
        handoff.src_block_ids, handoff.src_node = [], None
