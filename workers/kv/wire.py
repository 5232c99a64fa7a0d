"""A worker's side of KV copies between hosts: its pool's blocks to and from the wire.

    ReadBlocks  -> read_blocks()   chunks of the listed blocks as raw bytes (BlockData), each
                                   at most max_chunk_bytes (at least one block)
    WriteBlocks -> BlockWriter     each chunk into the listed blocks; after the last chunk one
                                   BlocksCopied (with the first error, if any chunk failed)
    WireCopies                     both, for one worker's pool: what to send back for each

The bytes are the pool's own layout, [layers, 2, n, block_size, kv_heads, head_dim] in the
pool's dtype, so both ends must have the same block shape and dtype (checked, never cast).
Nothing here decides which blocks: the scheduler orders every copy and holds its blocks.
Owns: the byte layout of blocks on the wire. Does not own: sockets (workers/process.py,
workers/link.py).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch

from justapi.wire.protocol import BlockData, BlocksCopied, ReadBlocks, WriteBlocks
from workers.kv.pool import KVPool

logger = logging.getLogger(__name__)

_EMPTY_U8 = np.zeros(0, dtype=np.uint8)


def block_bytes(pool: KVPool) -> int:
    """Bytes of one block of the pool: every layer's K and V."""
    s = pool.shape
    return (s.num_layers * 2 * s.block_size * s.num_kv_heads * s.head_dim
            * pool.tensor.element_size())


def dtype_name(pool: KVPool) -> str:
    return str(pool.tensor.dtype).removeprefix("torch.")


def read_blocks(pool: KVPool, order: ReadBlocks, worker_id: int) -> Iterator[BlockData]:
    """The order's blocks in chunks; one BlockData with `error` if the order is bad."""
    dtype = dtype_name(pool)
    try:
        ids = _block_ids(order.block_ids, pool.shape.num_blocks)
    except ValueError as exc:
        yield BlockData(order.copy_id, worker_id, 0, 0, dtype, _EMPTY_U8, True, str(exc))
        return
    per_chunk = max(1, int(order.max_chunk_bytes) // max(1, block_bytes(pool)))
    if not len(ids):
        yield BlockData(order.copy_id, worker_id, 0, 0, dtype, _EMPTY_U8, True)
    for first in range(0, len(ids), per_chunk):
        part = ids[first:first + per_chunk]
        data = pool.tensor.index_select(2, part.to(pool.tensor.device))  # [L, 2, n, bs, kvh, hd]
        raw = data.cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
        yield BlockData(order.copy_id, worker_id, first, len(part), dtype, raw,
                        is_last=first + per_chunk >= len(ids))


class BlockWriter:
    """Writes the chunks of relayed copies into the worker's pool, one ack per copy."""

    def __init__(self, pool: KVPool, worker_id: int) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self._written: dict[int, int] = {}  # copy id -> blocks written so far
        self._failed: dict[int, str] = {}  # copy id -> its first error

    def write(self, chunk: WriteBlocks) -> BlocksCopied | None:
        """Write one chunk; the copy's BlocksCopied after its last chunk, else None."""
        copy_id = chunk.copy_id
        if chunk.error:
            self._failed.setdefault(copy_id, chunk.error)
        elif copy_id not in self._failed:
            try:
                self._copy(chunk)
                self._written[copy_id] = self._written.get(copy_id, 0) + len(chunk.dst_block_ids)
            except (ValueError, RuntimeError) as exc:
                logger.error("copy %d: writing %d blocks failed: %s", copy_id,
                             len(chunk.dst_block_ids), exc)
                self._failed[copy_id] = f"{type(exc).__name__}: {exc}"
        if not chunk.is_last:
            return None
        error = self._failed.pop(copy_id, None)
        num_blocks = self._written.pop(copy_id, 0)
        if self.pool.tensor.is_cuda:
            torch.cuda.synchronize(self.pool.tensor.device)
        return BlocksCopied(copy_id, self.worker_id, 0 if error else num_blocks, error)

    def _copy(self, chunk: WriteBlocks) -> None:
        pool = self.pool
        if chunk.dtype != dtype_name(pool):
            raise ValueError(f"blocks of dtype {chunk.dtype!r} cannot go into a "
                             f"{dtype_name(pool)} pool")
        ids = _block_ids(chunk.dst_block_ids, pool.shape.num_blocks)
        expected = len(ids) * block_bytes(pool)
        if chunk.data.nbytes != expected:
            raise ValueError(f"{len(ids)} blocks need {expected} bytes, the chunk has "
                             f"{chunk.data.nbytes}")
        if not len(ids):
            return
        dims = list(pool.shape.dims)
        dims[2] = len(ids)
        raw = chunk.data if chunk.data.flags.writeable else chunk.data.copy()  # (zmq frames are)
        data = torch.from_numpy(raw).view(pool.tensor.dtype).view(dims)  # [L, 2, n, bs, kvh, hd]
        pool.tensor.index_copy_(2, ids.to(pool.tensor.device), data.to(pool.tensor.device))


class WireCopies:
    """A worker's answers to relayed copy orders (workers on several hosts)."""

    def __init__(self, pool: KVPool, worker_id: int) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.writer = BlockWriter(pool, worker_id)

    def handle(self, order: ReadBlocks | WriteBlocks) -> Iterator[BlockData | BlocksCopied]:
        """ReadBlocks: its chunks, one at a time; WriteBlocks: the copy's ack after its last."""
        if isinstance(order, ReadBlocks):
            yield from read_blocks(self.pool, order, self.worker_id)
            return
        ack = self.writer.write(order)
        if ack is not None:
            yield ack


def _block_ids(ids: np.ndarray, num_blocks: int) -> torch.Tensor:
    array = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(array) and (array.min() < 0 or array.max() >= num_blocks):
        bad = array[(array < 0) | (array >= num_blocks)][:4].tolist()
        raise ValueError(f"block id out of range [0, {num_blocks}): {bad}")
    if len(np.unique(array)) != len(array):
        raise ValueError("a block is listed twice")
    return torch.from_numpy(array)
