"""Waiting-queue policies: in which order waiting requests are offered for admission, and
which running request is preempted when blocks run out.

- fcfs: arrival order; with the stall-free step budget on (step_budget.py), fewest remaining
  prompt tokens first (after a probe of the prefix cache), aged so that a request waiting
  PREFILL_AGING_STEPS steps ranks first - a new conversation turn goes ahead of long prompts.
  Like lpm's ranking, only while at most lpm_max_waiting requests wait and none has waited
  lpm_max_wait_steps steps; else arrival order.
- priority: (priority, arrival) - lower priority value first.
- lpm: longest cached prefix first (ties by arrival), computed only while at most
  lpm_max_waiting requests wait (ranking costs one tree probe each); above that, or when the
  oldest waiting request has waited more than lpm_max_wait_steps steps, plain FCFS - so a
  request whose prefix is never cached still gets in.
- preemption victim: the largest sort_key, i.e. the newest request (lowest priority first
  under the priority policy).
Admission is head-of-line: the caller stops at the first candidate that does not fit.
Owns: these orders. Does not own: the queues (WaitingQueue) or the budgets (StepBatch).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from justapi.config.sections import SchedulerConfig
from justapi.scheduler.kv.manager import KvCacheManager
from justapi.scheduler.request import Request
from justapi.scheduler.step_budget import ITL_TARGET_OFF, prefill_rank
from justapi.scheduler.waiting_queue import WaitingQueue


def sort_key(policy: str, priority: int, seq: int) -> tuple[int, int]:
    return (priority, seq) if policy == "priority" else (0, seq)


class AdmissionOrder:
    """Candidates for admission from one pool's queue, best first."""

    def __init__(self, config: SchedulerConfig, kv: KvCacheManager) -> None:
        self.config = config
        self.kv = kv

    def candidates(self, queue: WaitingQueue, pool_id: int, step_id: int) -> Iterator[Request]:
        """Yield requests to try; the caller admits (removing it from the queue) or stops."""
        policy = self.config.policy
        is_shortest = policy == "fcfs" and self.config.itl_target_ms != ITL_TARGET_OFF
        if not (policy == "lpm" or is_shortest) or len(queue) > self.config.lpm_max_waiting:
            return self._queue_order(queue)
        oldest = queue.peek()
        if oldest is None or step_id - oldest.enqueued_step > self.config.lpm_max_wait_steps:
            return self._queue_order(queue)
        if is_shortest:
            return self._shortest_first(queue, pool_id, step_id)
        return self._longest_prefix_first(queue, pool_id)

    @staticmethod
    def _queue_order(queue: WaitingQueue) -> Iterator[Request]:
        last = None
        while True:
            req = queue.peek()
            if req is None or req is last:  # the caller did not take the last one: stop
                return
            last = req
            yield req

    def _probe(self, pool_id: int, req: Request) -> int:
        """Cached blocks of req's tokens; 0 where the probe fails (ranked as uncached, its
        admission fails it alone: planner.py)."""
        try:
            return self.kv.probe(pool_id, req.token_bytes(), req.cache_salt, req.num_tokens)
        except Exception:
            return 0

    def _longest_prefix_first(self, queue: WaitingQueue, pool_id: int) -> Iterator[Request]:
        probe = self._probe
        ranked = sorted(queue, key=lambda r: (-probe(pool_id, r), r.sort_key))
        for req in ranked:
            if req.queue_entry is not None:
                yield req

    def _shortest_first(self, queue: WaitingQueue, pool_id: int, step_id: int) -> Iterator[Request]:
        probe, block_size = self._probe, self.kv.block_size
        ranked = sorted(queue, key=lambda r: (prefill_rank(
            r.num_tokens - block_size * probe(pool_id, r), step_id - r.enqueued_step),
            r.sort_key))
        for req in ranked:
            if req.queue_entry is not None:
                yield req


def choose_victim(requester: Request, candidates: Iterable[Request]) -> Request | None:
    """The request to preempt so `requester` can get blocks: the largest sort_key among
    running requests not in flight that are newer (or lower priority) than the requester."""
    best = None
    for req in candidates:
        if (req is requester or req.is_in_flight or not req.block_ids
                or req.sort_key <= requester.sort_key):
            continue
        if best is None or req.sort_key > best.sort_key:
            best = req
    return best


def has_newer_holder(requester: Request, candidates: Iterable[Request]) -> bool:
    """Is a newer request (in flight, so not preemptable now) holding blocks of the pool?"""
    return any(req is not requester and req.sort_key > requester.sort_key and req.block_ids
               for req in candidates)
