"""KV hand-offs of prefill/decode disaggregation: a request whose prompt is computed, between
its prefill worker and the decode worker that will claim it.

    prefill step returns -> HandOff(src pool) -+- zero-copy (decode workers map the src pool):
                                               |      any decode worker of that pool claims it
                                               +- copy: a decode pool's blocks are reserved
                                                  (held by `holder`), CopyBlocks to one decode
                                                  worker; on BlocksCopied the request swaps its
                                                  table to them and that worker claims it

While a copy is in flight the request counts as in flight (an abort waits for the ack). A
hand-off whose lease lapses before a claim is taken back: the request is re-queued for
recompute; a copy still in flight becomes an orphan whose blocks (both sides) stay held until
the ack arrives or the copying worker is declared dead.
Owns: hand-off records and their lookups. Does not own: the transitions (state.py,
pd_scheduler.py) or block accounting (KvCacheManager).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from justapi.scheduler.kv.radix_node import RadixNode
from justapi.scheduler.request import Request


@dataclass(eq=False)
class HandOff:
    """One request between pools. Blocks listed here are held under `holder` (copy path)."""

    req: Request | None  # None once orphaned (the request went back to the queue)
    src_pool_id: int
    dst_pool_id: int  # == src_pool_id: zero-copy; -1 until a copy destination is chosen
    created_s: float
    num_blocks: int  # blocks of the computed tokens handed over
    copy_id: int = -1
    worker_id: int = -1  # copy path: the decode worker that copies and then claims it
    is_copied: bool = False
    dst_block_ids: list[int] = field(default_factory=list)  # held by holder until the ack
    dst_node: RadixNode | None = None  # decode-side cached prefix among dst_block_ids
    num_dst_cached: int = 0
    src_block_ids: list[int] = field(default_factory=list)  # held by holder once orphaned
    src_node: RadixNode | None = None

    @property
    def holder(self) -> str:
        """Holder name of the blocks the hand-off itself holds (never a request id)."""
        return f"\x00copy-{self.copy_id}"

    @property
    def is_zero_copy(self) -> bool:
        return self.dst_pool_id == self.src_pool_id

    @property
    def is_copy_in_flight(self) -> bool:
        return self.copy_id >= 0 and not self.is_copied

    @property
    def is_ready(self) -> bool:
        """A decode worker can claim it now."""
        return self.is_zero_copy or self.is_copied


class HandOffTable:
    """Live hand-offs by request id, copies in flight by copy id, and orphaned copies."""

    def __init__(self) -> None:
        self.by_request: dict[str, HandOff] = {}
        self.copies: dict[int, HandOff] = {}  # copies in flight (live or orphaned)
        self.next_copy_id = 0

    def __len__(self) -> int:
        return len(self.by_request)

    def __bool__(self) -> bool:
        return bool(self.by_request)

    def add(self, handoff: HandOff) -> None:
        assert handoff.req is not None and handoff.req.request_id not in self.by_request
        self.by_request[handoff.req.request_id] = handoff

    def get(self, request_id: str) -> HandOff | None:
        return self.by_request.get(request_id)

    def remove(self, req: Request) -> HandOff:
        return self.by_request.pop(req.request_id)

    def start_copy(self, handoff: HandOff) -> int:
        self.next_copy_id += 1
        handoff.copy_id = self.next_copy_id
        self.copies[handoff.copy_id] = handoff
        return handoff.copy_id

    def end_copy(self, copy_id: int) -> HandOff | None:
        return self.copies.pop(copy_id, None)

    def in_order(self) -> list[HandOff]:
        """Live hand-offs, oldest request first (the policy's sort key)."""
        return sorted(self.by_request.values(), key=lambda h: h.req.sort_key)  # type: ignore[union-attr]

    def in_pool(self, pool_id: int) -> Iterator[Request]:
        """Requests of live hand-offs whose own blocks are in pool_id (preemption candidates)."""
        return (h.req for h in self.by_request.values()
                if h.req is not None and h.req.pool_id == pool_id)

    def in_flight_request_ids(self) -> set[str]:
        return {h.req.request_id for h in self.copies.values() if h.req is not None}

    def holdings(self) -> Iterator[tuple[str, list[int]]]:
        """(holder, blocks) of every hand-off that holds blocks itself (invariants)."""
        for handoff in self.copies.values():
            blocks = handoff.dst_block_ids + handoff.src_block_ids
            if blocks:
                yield handoff.holder, blocks
