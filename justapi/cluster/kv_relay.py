"""The scheduler's relay for KV copies a destination worker cannot make by mapping the source
pool (another host's memory): the bytes travel source worker -> scheduler -> destination.

    start(order)        CopyBlocks for worker D from pool S -> ReadBlocks to a worker of S
    forward(chunk)      each BlockData chunk -> WriteBlocks to D (the same frames, not copied)
    on_worker_lost(w)   a source lost mid-copy: D gets a final WriteBlocks with the error, so
                        D's BlocksCopied (an error) releases the blocks only after D has
                        written everything it was sent; a lost destination: the core decides

Every worker connects only to the scheduler (one CURVE endpoint, no mesh), at the price of
the bytes crossing the scheduler's host twice (docs/scale-out.md has the figures).
Owns: relayed copies in flight and their counters. Does not own: which blocks to copy or
when (the scheduler core), sockets (the scheduler process, through justapi/cluster/links.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from justapi.wire.protocol import (
    BlockData,
    CopyBlocks,
    PoolInfo,
    ReadBlocks,
    WriteBlocks,
)

MAX_CHUNK_BYTES = 32 << 20  # well under transport.MAX_MESSAGE_BYTES; keeps sends interleaved
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_U8 = np.zeros(0, dtype=np.uint8)


@dataclass(eq=False)
class RelayedCopy:
    order: CopyBlocks
    dst_worker: int
    src_worker: int
    num_forwarded: int = 0  # blocks passed on to the destination so far


def needs_relay(order: CopyBlocks, dst: PoolInfo) -> bool:
    """A destination maps a source pool itself only when it is a shared-memory segment on its
    own host (or its own pool); any other copy goes over the wire."""
    src = order.src
    if src is None or src.pool_id == dst.pool_id:
        return False
    return not (src.kind == "shm" and src.host == dst.host)


class KvRelay:
    def __init__(self, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        self.max_chunk_bytes = max_chunk_bytes
        self.copies: dict[int, RelayedCopy] = {}  # copy id ->
        self.num_relayed = 0
        self.relayed_bytes = 0

    def start(self, order: CopyBlocks, dst_worker: int, src_worker: int) -> ReadBlocks:
        self.copies[order.copy_id] = RelayedCopy(order, dst_worker, src_worker)
        self.num_relayed += 1
        return ReadBlocks(order.copy_id, order.src_block_ids, self.max_chunk_bytes)

    def forward(self, chunk: BlockData) -> tuple[int, WriteBlocks] | None:
        """The destination's WriteBlocks for a source chunk; None for a stray or late chunk."""
        copy = self.copies.get(chunk.copy_id)
        if copy is None or chunk.worker_id != copy.src_worker:
            return None
        if chunk.error:
            return self.fail(chunk.copy_id, f"reading the blocks on worker {copy.src_worker} "
                                            f"failed: {chunk.error}")
        first, count = chunk.first, chunk.num_blocks
        total = len(copy.order.dst_block_ids)
        end = first + count
        if first != copy.num_forwarded or end > total or (chunk.is_last and end != total):
            return self.fail(chunk.copy_id, f"worker {copy.src_worker} sent blocks "
                                            f"[{first}, {end}) of {total} out of order")
        copy.num_forwarded = end
        if chunk.is_last:
            del self.copies[chunk.copy_id]
        self.relayed_bytes += chunk.data.nbytes
        return copy.dst_worker, WriteBlocks(chunk.copy_id, copy.order.dst_block_ids[first:end],
                                            chunk.dtype, chunk.data, chunk.is_last)

    def fail(self, copy_id: int, reason: str) -> tuple[int, WriteBlocks] | None:
        """End a copy with an error the destination answers (after what it was sent)."""
        copy = self.copies.pop(copy_id, None)
        if copy is None:
            return None
        return copy.dst_worker, WriteBlocks(copy_id, _EMPTY_I32, "", _EMPTY_U8, True, reason)

    def on_worker_lost(self, worker_id: int) -> list[tuple[int, WriteBlocks]]:
        """Copies reading from the lost worker fail at their destination; copies into it are
        forgotten (the core gives those up with the worker)."""
        out = []
        for copy_id, copy in list(self.copies.items()):
            if copy.src_worker == worker_id:
                failed = self.fail(copy_id, f"worker {worker_id}, which was reading the source "
                                            "blocks, was lost")
                if failed is not None:
                    out.append(failed)
            elif copy.dst_worker == worker_id:
                del self.copies[copy_id]
        return out
