"""All mutable state of one scheduler core and the request lifecycle transitions.

    add -> WAITING (pool queue) -> admit -> RUNNING (on a worker, holds blocks)
              ^                               |  ^   preempt: free blocks, keep tokens
              |                        detach |  | claim     (LongRoPE's recompute too)
              |                               |  |           finish: free blocks
              +---------------------- HANDOFF (PD: between workers, holds blocks)

Shared by the planner (schedule), the result applier (update), Scheduler and PdScheduler.
Owns: requests, per-pool queues / running sets / block reservations, workers, KV hand-offs,
counters (and failures by stage: faults.py). Does not own: the policy of who runs when
(planner.py), block accounting (KvCacheManager).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.scheduler.faults import RequestFaults
from justapi.scheduler.kv.block_pool import BlockPool
from justapi.scheduler.kv.manager import KvCacheManager
from justapi.scheduler.long_rope import LongRope
from justapi.scheduler.pd.handoff_table import HandOffTable
from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.spec.speculation import Speculation
from justapi.scheduler.topology import (
    ROLE_DECODE,
    ROLE_PREFILL,
    ModelLimits,
    PoolSpec,
    Topology,
    WorkerSpec,
)
from justapi.scheduler.waiting_queue import WaitingQueue
from justapi.scheduler.worker_state import WorkerState

if TYPE_CHECKING:
    from justapi.scheduler.structured import StructuredOutputs


@dataclass
class Counters:
    """Monotonic totals since start (Prometheus counters)."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_errors: int = 0
    num_preemptions: int = 0
    num_step_retries: int = 0  # requests of a failed worker step re-queued instead of failed
    num_long_rope_recomputes: int = 0  # LongRoPE: sequences recomputed with the long table
    num_multi_step_plans: int = 0  # plans of several decode steps (multi-step decoding)
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class SchedulerState:
    """Requests, queues, workers and blocks of one scheduler core."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, topology: Topology,
                 limits: ModelLimits) -> None:
        self.config = config
        self.block_size = cache.block_size
        self.limits = limits
        self.eos_token_ids = frozenset(limits.eos_token_ids)
        self.long_rope = LongRope(limits.long_rope_context)  # a no-op without LongRoPE
        self.pool = BlockPool(())
        self.kv = KvCacheManager(self.pool, cache.block_size, cache.enable_prefix_cache)
        self.queues: dict[int, WaitingQueue] = {}
        self.pool_running: dict[int, dict[str, Request]] = {}
        self.reservations: dict[int, Request | None] = {}
        self.workers: dict[int, WorkerState] = {}
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.handoffs = HandOffTable()  # PD only: requests between a prefill and a decode worker
        self.spec: Speculation | None = None  # speculative decoding, when on (scheduler.py)
        self.structured: StructuredOutputs | None = None  # grammars (factory.py; None: refused)
        self.counters = Counters()
        self.faults = RequestFaults(self)  # one request's failure, kept to it (faults.py)
        self.step_id = 0
        self.next_seq = 0
        for spec in topology.pools:
            self.add_pool(spec)
        for worker in topology.workers:
            self.add_worker(worker)

    def add_pool(self, spec: PoolSpec) -> None:
        self.pool.add_pool(spec)
        self.kv.add_pool(spec.pool_id)
        self.queues[spec.pool_id] = WaitingQueue()
        self.pool_running[spec.pool_id] = {}
        self.reservations[spec.pool_id] = None

    def add_worker(self, spec: WorkerSpec) -> None:
        if spec.pool_id not in self.queues:
            raise ValueError(f"worker {spec.worker_id} maps unknown pool {spec.pool_id}")
        self.workers[spec.worker_id] = WorkerState(spec.worker_id, spec.pool_id, spec.role)

    # ------------------------------------------------------------------ queries
    def pool_capacity_tokens(self, pool_id: int) -> int:
        return self.pool.num_blocks(pool_id) * self.block_size

    def healthy_workers(self, pool_id: int) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.pool_id == pool_id and w.is_healthy]

    def accepting_workers(self, pool_id: int) -> list[WorkerState]:
        """Workers of the pool that admit new requests (see admits)."""
        return [w for w in self.workers.values() if w.pool_id == pool_id and self.admits(w)]

    def has_healthy(self, role: str) -> bool:
        return any(w.is_healthy and w.role == role for w in self.workers.values())

    def admits(self, worker: WorkerState) -> bool:
        """May the worker admit waiting requests? When healthy and not draining - except a PD
        decode worker, unless no prefill worker is healthy (PD degrades to colocated then)."""
        return worker.is_accepting and (worker.role != ROLE_DECODE
                                        or not self.has_healthy(ROLE_PREFILL))

    def pool_load(self, pool_id: int) -> float:
        """Requests (running + waiting) per healthy worker of the pool; inf without one."""
        num_workers = len(self.healthy_workers(pool_id))
        if not num_workers:
            return float("inf")
        return (len(self.pool_running[pool_id]) + len(self.queues[pool_id])) / num_workers

    def holders(self, pool_id: int) -> list[Request]:
        """Requests holding blocks of the pool that preemption may take them from."""
        running = list(self.pool_running[pool_id].values())
        if self.handoffs:
            running.extend(self.handoffs.in_pool(pool_id))
        return running

    # ------------------------------------------------------------------ transitions
    def place(self, req: Request, pool_id: int) -> None:
        """Bind a waiting request to a pool (routing); its context cap follows the pool."""
        req.pool_id = pool_id
        req.max_len = min(self.limits.max_context, self.pool_capacity_tokens(pool_id))
        req.final_len = min(req.max_len, req.num_prompt_tokens + (
            0 if req.pooling else req.sampling.max_tokens))

    def enqueue(self, req: Request) -> None:
        self.long_rope.take_table(req)  # (it holds no KV now)
        req.status = RequestStatus.WAITING
        req.worker_id = -1
        self.queues[req.pool_id].push(req, self.step_id)

    def admit(self, req: Request, worker: WorkerState) -> None:
        """Waiting -> running on `worker` (the caller has given it blocks)."""
        self.queues[req.pool_id].remove(req)
        req.status = RequestStatus.RUNNING
        req.worker_id = worker.worker_id
        worker.running[req.request_id] = req
        worker.learn(req.request_id)
        self.pool_running[req.pool_id][req.request_id] = req

    def detach(self, req: Request) -> None:
        """Running -> hand-off (PD): leave the prefill worker, keep the blocks."""
        assert req.status is RequestStatus.RUNNING and not req.is_in_flight
        self._unbind(req)
        req.draft_token_ids = []
        req.status = RequestStatus.HANDOFF

    def claim(self, req: Request, worker: WorkerState) -> None:
        """Hand-off -> running on a decode worker of the pool that holds its blocks."""
        assert req.status is RequestStatus.HANDOFF and worker.pool_id == req.pool_id
        self.handoffs.remove(req)
        req.status = RequestStatus.RUNNING
        req.worker_id = worker.worker_id
        worker.running[req.request_id] = req
        worker.learn(req.request_id)
        self.pool_running[req.pool_id][req.request_id] = req

    def preempt(self, req: Request) -> None:
        """Running (or handed off) -> waiting: free its blocks, keep its tokens, queue it by
        its original key."""
        assert req.status in (RequestStatus.RUNNING, RequestStatus.HANDOFF) and not req.is_in_flight
        self._release(req)
        req.retry_pending = False  # a retry waiting for its step to land (retries.py): this is it
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.enqueue(req)

    def recompute(self, req: Request) -> None:
        """LongRoPE: a running request whose tokens outgrew the original context on the short
        table -> waiting (as a preemption: blocks freed, tokens kept, queued by its original
        key), to be prefilled whole with the long table (long_rope.py)."""
        assert req.status is RequestStatus.RUNNING and not req.is_in_flight
        assert self.long_rope.must_recompute(req)
        self._release(req)
        self.counters.num_long_rope_recomputes += 1
        self.enqueue(req)

    def finish(self, req: Request, reason: str) -> None:
        """Any state -> finished, freeing whatever it held."""
        assert not req.is_in_flight, f"{req.request_id} finished while in flight"
        if req.status in (RequestStatus.RUNNING, RequestStatus.HANDOFF):
            self._release(req)
        elif req.status is RequestStatus.WAITING:
            self.queues[req.pool_id].remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self.counters.num_finished += 1

    def _release(self, req: Request) -> None:
        """Free everything a running or handed-off request holds."""
        if req.status is RequestStatus.HANDOFF:
            self.handoffs.remove(req)
        else:
            self._unbind(req)
        self.kv.free(req)
        req.draft_token_ids = []

    def _unbind(self, req: Request) -> None:
        worker = self.workers[req.worker_id]
        del worker.running[req.request_id]
        worker.forget(req.request_id)
        del self.pool_running[req.pool_id][req.request_id]
        if self.reservations[req.pool_id] is req:
            self.reservations[req.pool_id] = None
        req.worker_id = -1
