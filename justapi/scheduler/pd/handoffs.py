"""The KV hand-off transitions of PdScheduler: hand off, order copies, adopt copies, claim,
take back (lease lapsed, decode side lost), and re-route queued requests to prefill pools.

    hand_off(req)       prefill step returned with the prompt computed: RUNNING -> HANDOFF
    order_copies()      copy path: decode-pool blocks reserved (decode-side cached prefix
                        reused), CopyBlocks to the decode worker with the most room
    copy_done(ack)      the request releases its prefill blocks (they stay cached there) and
                        takes the copied ones; or, aborted meanwhile, finishes
    claim(worker)       a decode worker takes ready hand-offs into its next step
    expire(now)         lease lapsed: re-queue for recompute (a copy in flight is orphaned:
                        its blocks stay held until its ack or its worker's death)
    on_worker_lost(w)   copies to w are redone elsewhere; its unclaimed hand-offs move on;
                        a GPU pool that died with its last worker: its hand-offs recompute

Owns: those transitions and the PD counters. Does not own: the records (handoff.py), block
accounting (KvCacheManager), when they are called (pd_scheduler.py).
"""
from __future__ import annotations

import numpy as np

from justapi.scheduler.batch import StepBatch
from justapi.scheduler.deltas import DeltaBuilder
from justapi.scheduler.pd.handoff_table import HandOff
from justapi.scheduler.pd.stats import LatencyHistogram, PdCounters
from justapi.scheduler.planner import StepPlanner
from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.router import Router
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.topology import ROLE_DECODE
from justapi.scheduler.worker_state import WorkerState
from justapi.wire.protocol import FINISH_ABORT, FINISH_ERROR, BlocksCopied, CopyBlocks, PoolInfo

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class HandOffManager:
    def __init__(self, state: SchedulerState, planner: StepPlanner, router: Router,
                 lease_s: float) -> None:
        self.state = state
        self.planner = planner
        self.router = router
        self.kv = state.kv
        self.handoffs = state.handoffs
        self.lease_s = lease_s
        self.pool_infos: dict[int, PoolInfo] = {}  # pool id -> its handle (workers' Ready)
        self.counters = PdCounters()
        self.latency = LatencyHistogram()
        self.now_s = 0.0

    # ------------------------------------------------------------------ queries
    def decode_workers(self, pool_id: int | None = None) -> list[WorkerState]:
        """Decode workers that take hand-offs (healthy, not draining), of one pool or all."""
        return [w for w in self.state.workers.values() if w.role == ROLE_DECODE and w.is_accepting
                and (pool_id is None or w.pool_id == pool_id)]

    def block_bytes(self, pool_id: int) -> int:
        info = self.pool_infos.get(pool_id)
        if info is None:
            return 0
        return (info.num_layers * 2 * info.block_size * info.num_kv_heads * info.head_dim
                * DTYPE_BYTES.get(info.dtype, 4))

    # ------------------------------------------------------------------ hand off
    def after_step(self, worker: WorkerState, reqs: list[Request]) -> None:
        """Requests of a prefill worker whose prompt is computed move to the decode side (not a
        LongRoPE one whose first token outgrew the original context: the worker's next plan
        recomputes it, long_rope.py)."""
        if not self.decode_workers():
            return  # no decode side: the prefill worker decodes them itself (degraded)
        for req in reqs:
            if (req.status is RequestStatus.RUNNING and req.worker_id == worker.worker_id
                    and not req.is_in_flight and req.is_decode
                    and not self.state.long_rope.must_recompute(req)):
                self.hand_off(req)

    def hand_off(self, req: Request) -> None:
        self.state.detach(req)
        src = req.pool_id
        dst = src if self.decode_workers(src) else -1  # zero-copy, or a copy (destination later)
        num_blocks = self.kv.num_blocks_for(req.num_computed_tokens)
        self.handoffs.add(HandOff(req, src, dst, self.now_s, num_blocks))
        counters = self.counters
        counters.num_handoffs += 1
        counters.handoff_blocks += num_blocks
        counters.handoff_bytes += num_blocks * self.block_bytes(src)

    # ------------------------------------------------------------------ copy path
    def order_copies(self) -> list[tuple[int, CopyBlocks]]:
        """Copy orders for hand-offs that need one, oldest first, head-of-line (the first that
        finds no decode worker with room or no blocks stops the rest)."""
        out: list[tuple[int, CopyBlocks]] = []
        if not self.handoffs:
            return out
        assigned: dict[int, int] = {}  # decode worker -> copies it makes or will claim
        busy = [*self.handoffs.copies.values(),
                *(h for h in self.handoffs.by_request.values() if h.is_copied)]
        for handoff in busy:
            assigned[handoff.worker_id] = assigned.get(handoff.worker_id, 0) + 1
        for handoff in self.handoffs.in_order():
            if handoff.is_ready or handoff.is_copy_in_flight:
                continue
            worker = self._copy_target(handoff, assigned)
            if worker is None or not self._reserve_destination(handoff, worker):
                break
            assigned[worker.worker_id] = assigned.get(worker.worker_id, 0) + 1
            order = self._copy_order(handoff)
            if order is None:  # the decode side had every block cached already
                self._adopt(self.handoffs.end_copy(handoff.copy_id))  # type: ignore[arg-type]
            else:
                out.append((worker.worker_id, order))
        return out

    def _copy_target(self, handoff: HandOff, assigned: dict[int, int]) -> WorkerState | None:
        max_seqs = self.state.config.max_seqs
        room = [w for w in self.decode_workers() if w.pool_id != handoff.src_pool_id
                and len(w.running) + assigned.get(w.worker_id, 0) < max_seqs]
        return min(room, key=lambda w: (len(w.running) + assigned.get(w.worker_id, 0),
                                        w.worker_id), default=None)

    def _reserve_destination(self, handoff: HandOff, worker: WorkerState) -> bool:
        """Hold blocks for the hand-off in the worker's pool: the decode side's cached prefix
        of the request, then fresh blocks for the rest (respecting an older reservation)."""
        req = handoff.req
        assert req is not None
        dst = worker.pool_id
        self.handoffs.start_copy(handoff)
        holder = handoff.holder
        max_cached = min(handoff.num_blocks, (req.num_tokens - 1) // self.state.block_size)
        match = self.kv.hold_prefix(dst, req.token_bytes(), req.cache_salt, max_cached, holder)
        need = handoff.num_blocks - match.num_blocks
        reserved = self.state.reservations[dst]
        fresh = None if (reserved is not None and reserved.sort_key < req.sort_key) \
            else self.kv.allocate_blocks(dst, need, holder)
        if fresh is None:
            self.kv.release(dst, match.block_ids, match.node, holder)
            self.handoffs.end_copy(handoff.copy_id)
            handoff.copy_id = -1
            return False
        handoff.dst_pool_id, handoff.worker_id = dst, worker.worker_id
        handoff.dst_block_ids = match.block_ids + fresh
        handoff.dst_node, handoff.num_dst_cached = match.node, match.num_blocks
        req.is_in_flight = True  # an abort now waits for the copy's ack
        return True

    def _copy_order(self, handoff: HandOff) -> CopyBlocks | None:
        """Blocks [num_dst_cached, num_blocks) go from the request's table to the reserved ones."""
        req = handoff.req
        assert req is not None
        src, dst = handoff.src_pool_id, handoff.dst_pool_id
        first = handoff.num_dst_cached
        src_ids = np.asarray(req.block_ids[first:handoff.num_blocks], dtype=np.int32)
        dst_ids = np.asarray(handoff.dst_block_ids[first:], dtype=np.int32)
        if not len(dst_ids):
            return None
        counters = self.counters
        counters.num_copies += 1
        counters.copied_blocks += len(dst_ids)
        counters.copied_bytes += len(dst_ids) * self.block_bytes(src)
        return CopyBlocks(copy_id=handoff.copy_id, src_pool=src,
                          src_block_ids=src_ids - np.int32(self.state.pool.base(src)),
                          dst_block_ids=dst_ids - np.int32(self.state.pool.base(dst)),
                          src=self.pool_infos.get(src))

    def copy_done(self, ack: BlocksCopied, deltas: DeltaBuilder) -> None:
        handoff = self.handoffs.end_copy(ack.copy_id)
        if handoff is None:
            return  # given up with its worker (on_worker_lost): a late answer
        if ack.worker_id != handoff.worker_id:
            raise ValueError(f"worker {ack.worker_id} acknowledged copy {ack.copy_id}, ordered "
                             f"from worker {handoff.worker_id}")
        req = handoff.req
        if req is None:  # orphaned by its lease: nothing reads these blocks any more
            self._release_holdings(handoff)
            return
        req.is_in_flight = False
        if req.is_abort_pending or ack.error:
            self._release_holdings(handoff)
            self._finish(req, ack, deltas)
        else:
            self._adopt(handoff)

    def _finish(self, req: Request, ack: BlocksCopied, deltas: DeltaBuilder) -> None:
        counters = self.state.counters
        if req.is_abort_pending:
            counters.num_aborted += 1
            self.state.finish(req, FINISH_ABORT)
            deltas.add(req, [], FINISH_ABORT)
            return
        self.counters.num_copy_errors += 1
        counters.num_errors += 1
        self.state.finish(req, FINISH_ERROR)
        deltas.add_error(req, FINISH_ERROR, f"KV hand-off to decode worker {ack.worker_id} "
                                            f"failed: {ack.error}")

    def _adopt(self, handoff: HandOff) -> None:
        """The copy is in place: the request lets its prefill blocks go (they stay cached on
        the prefill side) and holds the decode pool's, as computed."""
        req = handoff.req
        assert req is not None
        pool = self.state.pool
        num_computed = req.num_computed_tokens
        req.is_in_flight = False
        self.kv.free(req)
        req.pool_id = handoff.dst_pool_id
        for block_id in handoff.dst_block_ids:
            pool.acquire(block_id, req.request_id)
        pool.release(handoff.dst_block_ids, handoff.holder)
        req.block_ids.extend(handoff.dst_block_ids)
        req.cache_node, req.num_cached_blocks = handoff.dst_node, handoff.num_dst_cached
        req.num_computed_tokens = num_computed
        handoff.dst_block_ids, handoff.dst_node = [], None
        handoff.is_copied = True

    def _release_holdings(self, handoff: HandOff) -> None:
        holder = handoff.holder
        if handoff.dst_block_ids:
            self.kv.release(handoff.dst_pool_id, handoff.dst_block_ids, handoff.dst_node, holder)
        if handoff.src_block_ids:
            self.kv.release(handoff.src_pool_id, handoff.src_block_ids, handoff.src_node, holder)
        handoff.dst_block_ids, handoff.dst_node = [], None
        handoff.src_block_ids, handoff.src_node = [], None

    # ------------------------------------------------------------------ claims
    def claim(self, worker: WorkerState, batch: StepBatch) -> None:
        """A decode worker takes ready hand-offs (zero-copy ones of its pool, copies it made),
        oldest first, while max_seqs, the decode budget and its fair share allow."""
        if not self.handoffs:
            return
        takes_new = worker.is_accepting  # a draining worker still claims the copies it made
        mine = [h for h in self.handoffs.in_order() if h.is_ready and (
            h.worker_id == worker.worker_id if h.is_copied
            else takes_new and h.dst_pool_id == worker.pool_id)]
        peers = self.decode_workers(worker.pool_id)
        share = -(-(sum(len(w.running) for w in peers) + len(mine)) // max(1, len(peers)))
        limit = min(self.state.config.max_seqs, share)
        for handoff in mine:
            if len(worker.running) >= limit or not batch.has_decode_room:
                return
            if handoff.req is not None and self.handoffs.get(handoff.req.request_id) is handoff:
                self._claim_one(handoff, worker, batch)  # (not preempted by an earlier claim)

    def _claim_one(self, handoff: HandOff, worker: WorkerState, batch: StepBatch) -> None:
        req = handoff.req
        assert req is not None
        rid = req.request_id
        had_drop = rid in worker.pending_drops
        self.state.claim(req, worker)
        self.latency.observe(max(0.0, self.now_s - handoff.created_s))
        num_tokens = min(1 + req.num_jumped, batch.budget_tokens)  # (+ a grammar's forced tokens)
        if self.planner.ensure_blocks(req, req.num_computed_tokens + num_tokens, batch):
            batch.add(req, num_tokens, is_prefill=False)
        if req.status is RequestStatus.RUNNING:
            batch.new_requests[rid] = req
        elif not had_drop:  # preempted itself before the worker ever heard of it
            worker.pending_drops.pop(rid, None)

    # ------------------------------------------------------------------ taking back
    def expire(self, deltas: DeltaBuilder) -> None:
        """Hand-offs unclaimed for lease_s go back to a queue (recompute)."""
        for handoff in list(self.handoffs.by_request.values()):
            if self.now_s - handoff.created_s >= self.lease_s:
                self.counters.num_leases_expired += 1
                self.take_back(handoff, deltas)

    def take_back(self, handoff: HandOff, deltas: DeltaBuilder) -> None:
        req = handoff.req
        assert req is not None
        if handoff.is_copy_in_flight:
            self._orphan(handoff)
        if req.is_abort_pending:
            self.state.counters.num_aborted += 1
            self.state.finish(req, FINISH_ABORT)
            deltas.add(req, [], FINISH_ABORT)
        else:
            self.state.preempt(req)

    def _orphan(self, handoff: HandOff) -> None:
        """Stop waiting for a copy: its holder keeps the source blocks it may still read (and
        the destination ones it writes) until the ack or the copying worker's death."""
        req = handoff.req
        assert req is not None
        handoff.src_block_ids = list(req.block_ids[:handoff.num_blocks])
        handoff.src_node = req.cache_node
        for block_id in handoff.src_block_ids:
            self.state.pool.acquire(block_id, handoff.holder)
        req.is_in_flight = False
        handoff.req = None  # the caller re-queues or finishes req, which drops it from the table

    def on_worker_lost(self, worker: WorkerState, deltas: DeltaBuilder) -> None:
        """Copies to the worker are given up (redone elsewhere: the source blocks are still
        there); hand-offs it would claim move to a peer or back to a queue."""
        for handoff in [h for h in self.handoffs.copies.values() if h.worker_id == worker.worker_id]:
            self.handoffs.end_copy(handoff.copy_id)
            self._release_holdings(handoff)
            req = handoff.req
            if req is None:
                continue
            req.is_in_flight = False
            handoff.copy_id, handoff.worker_id, handoff.dst_pool_id = -1, -1, -1
            if req.is_abort_pending:
                self.take_back(handoff, deltas)
        for handoff in list(self.handoffs.by_request.values()):
            self._rehome(handoff, worker, deltas)
        self.on_pool_lost(worker.pool_id, deltas)

    def on_pool_lost(self, pool_id: int, deltas: DeltaBuilder) -> None:
        """A pool whose memory died with its last worker (a GPU's: CUDA IPC): hand-offs not
        yet copied out of it are recomputed (a copy still reading it is orphaned)."""
        info = self.pool_infos.get(pool_id)
        if info is None or info.kind != "cuda_ipc" or self.state.healthy_workers(pool_id):
            return
        for handoff in list(self.handoffs.by_request.values()):
            if handoff.src_pool_id == pool_id and not handoff.is_copied:
                self.take_back(handoff, deltas)

    def _rehome(self, handoff: HandOff, lost: WorkerState, deltas: DeltaBuilder) -> None:
        if handoff.is_copied and handoff.worker_id == lost.worker_id:
            peers = self.decode_workers(handoff.dst_pool_id)
            if peers:
                handoff.worker_id = peers[0].worker_id
            else:
                self.take_back(handoff, deltas)
        elif handoff.is_zero_copy and not self.decode_workers(handoff.src_pool_id):
            handoff.dst_pool_id = -1  # copy it to another decode pool, if there is one
        if handoff.req is not None and handoff.req.status is RequestStatus.HANDOFF \
                and not self.decode_workers():
            self.take_back(handoff, deltas)

    def reroute(self) -> None:
        """Waiting requests of pools where nobody admits (a decode pool after a preemption)
        move to a pool where a worker does."""
        state = self.state
        for pool_id, queue in state.queues.items():
            if not len(queue) or state.accepting_workers(pool_id):
                continue
            for req in sorted(queue, key=lambda r: r.sort_key):
                target = self.router.choose_pool(req, exclude=pool_id)
                if target is not None and state.accepting_workers(target):
                    queue.remove(req)
                    state.place(req, target)
                    state.enqueue(req)
