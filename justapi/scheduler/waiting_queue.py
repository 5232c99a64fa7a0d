"""The waiting requests of one pool, ordered by Request.sort_key.

A heap with lazy removal: push/pop O(log n), remove O(1) (the entry is invalidated and
skipped when it reaches the top), so aborts and admissions never scan the queue.
sort_key is (0, seq) for fcfs/lpm and (priority, seq) for priority, so a preempted request,
re-pushed with its original key, goes back ahead of everything that arrived after it.
Owns: the heap and the live count. Does not own: the admission order of lpm (policy.py).
"""
from __future__ import annotations

import heapq
from collections.abc import Iterator

from justapi.scheduler.request import Request


class WaitingQueue:
    """Min-heap of [sort_key, request] entries; an entry is live while request.queue_entry is it."""

    def __init__(self) -> None:
        self._heap: list[list] = []
        self._num_live = 0

    def __len__(self) -> int:
        return self._num_live

    def push(self, req: Request, step: int) -> None:
        assert req.queue_entry is None, f"{req.request_id} is already queued"
        entry = [req.sort_key, req]
        req.queue_entry = entry
        req.enqueued_step = step
        heapq.heappush(self._heap, entry)
        self._num_live += 1

    def peek(self) -> Request | None:
        heap = self._heap
        while heap:
            req = heap[0][1]
            if req.queue_entry is heap[0]:
                return req
            heapq.heappop(heap)
        return None

    def remove(self, req: Request) -> None:
        assert req.queue_entry is not None, f"{req.request_id} is not queued"
        req.queue_entry = None
        self._num_live -= 1
        if len(self._heap) > 2 * self._num_live + 64:
            self._heap = [e for e in self._heap if e[1].queue_entry is e]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Live requests in no particular order (lpm ranking, invariants)."""
        return (e[1] for e in list(self._heap) if e[1].queue_entry is e)

    def check_invariants(self) -> None:
        live = [e for e in self._heap if e[1].queue_entry is e]
        assert len(live) == self._num_live, f"queue counts {self._num_live}, holds {len(live)}"
