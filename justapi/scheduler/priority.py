"""The priority policy's preemption (vLLM's semantics: lower value is sooner): a waiting
request that a worker cannot admit for want of a seat (max_seqs) or of KV blocks takes them
from the worker's running requests of a strictly lower priority (larger value), lowest
priority and newest first.

A victim that no step computes is preempted at once (blocks freed, tokens kept, re-queued by
its original key: it resumes after the request that displaced it). With overlap its step is
usually in flight: then it is held back from the plan being made, so that once that step
lands nothing computes it and the next plan preempts it - a preempted request is never under
a running step. Requests of equal priority never displace each other (no thrash).
Owns: the choice of victims and the hold-back set. Does not own: the preemption itself
(SchedulerState.preempt) or admission (planner.py).
"""
from __future__ import annotations

from collections.abc import Iterable

from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.worker_state import WorkerState


class PriorityPreemption:
    """Makes room on one worker for its pool's best waiting request (policy "priority")."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.is_enabled = state.config.policy == "priority" and state.config.scheduled

    def make_room(self, worker: WorkerState) -> set[str]:
        """Preempt what the head of the worker's queue needs now; returns the ids of victims
        still under a step in flight, to leave out of the plan being made."""
        if not self.is_enabled or not self.state.admits(worker):
            return set()
        head = self.state.queues[worker.pool_id].peek()
        if head is None:
            return set()
        victims = lower_priority(head, worker.running.values())
        held: set[str] = set()
        seats = len(worker.running) - self.state.config.max_seqs + 1  # seats to free
        blocks = self._blocks_short(head)
        for victim in victims:
            if seats <= 0 and blocks <= 0:
                break
            seats -= 1
            blocks -= len(victim.block_ids)
            if victim.is_in_flight:
                held.add(victim.request_id)
            else:
                self.state.preempt(victim)
        return held

    def _blocks_short(self, head: Request) -> int:
        """How many more blocks the head's first chunk needs than its pool can give now (its
        cached prefix aside); <= 0 when it fits."""
        kv = self.state.kv
        cached = kv.probe(head.pool_id, head.token_bytes(), head.cache_salt, head.num_tokens)
        first = min(head.num_tokens, cached * kv.block_size + self.state.config.chunk_size)
        need = kv.num_blocks_for(first) - cached
        return need - self.state.pool.num_available(head.pool_id)


def lower_priority(requester: Request, running: Iterable[Request]) -> list[Request]:
    """Running requests holding a seat that `requester` outranks (strictly lower priority),
    the first to go first: lowest priority, then newest."""
    victims = [r for r in running
               if r.status is RequestStatus.RUNNING and r.priority > requester.priority
               and not r.is_finishing]
    victims.sort(key=lambda r: r.sort_key, reverse=True)
    return victims
