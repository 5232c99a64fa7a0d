"""A decode worker's side of the PD KV hand-off: execute CopyBlocks orders into its own pool.

The source pool (a prefill worker's) is mapped once per handle through `KVPool.attach` with
the PoolInfo the order carries (a shared-memory segment on CPU, a CUDA IPC handle on GPU) and
kept mapped; the copy is synchronised before BlocksCopied goes back, so the scheduler may
reuse the source blocks as soon as it reads the ack. A failed order answers with its error.
Owns: the attached source pools. Does not own: which blocks to copy (the scheduler).
"""
from __future__ import annotations

import logging

import torch

from justapi.wire.protocol import BlocksCopied, CopyBlocks, PoolInfo
from workers.kv.pool import KVPool

logger = logging.getLogger(__name__)


class BlockCopier:
    def __init__(self, pool: KVPool, worker_id: int) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self._sources: dict[tuple[str, str], KVPool] = {}  # (kind, handle) -> attached pool

    def execute(self, order: CopyBlocks) -> BlocksCopied:
        try:
            source = self.source(order)
            self.pool.copy_blocks(source, order.src_block_ids, order.dst_block_ids)
            if self.pool.tensor.is_cuda:
                torch.cuda.synchronize(self.pool.tensor.device)
        except Exception as exc:  # one failed copy fails its request, not the worker
            logger.error("copy %d from pool %d failed: %s", order.copy_id, order.src_pool, exc)
            return BlocksCopied(order.copy_id, self.worker_id, 0, f"{type(exc).__name__}: {exc}")
        return BlocksCopied(order.copy_id, self.worker_id, len(order.dst_block_ids))

    def source(self, order: CopyBlocks) -> KVPool:
        """The order's source pool: our own, or one mapped (once) through its handle."""
        info = order.src
        if info is None:
            if order.src_pool != self.pool.pool_id:
                raise ValueError(f"copy {order.copy_id}: no handle for source pool {order.src_pool}")
            return self.pool
        if info.kind == self.pool.kind and info.handle == self.pool.handle and info.handle:
            return self.pool
        key = (info.kind, info.handle)
        pool = self._sources.get(key)
        if pool is None:
            pool = self._attach(info)
            self._sources[key] = pool
        return pool

    def _attach(self, info: PoolInfo) -> KVPool:
        stale = [key for key, pool in self._sources.items() if pool.pool_id == info.pool_id]
        for key in stale:  # the source pool was recreated (its worker restarted): drop the old map
            self._sources.pop(key).close()
        logger.info("mapping KV pool %d (%s %s) for hand-offs", info.pool_id, info.kind,
                    info.handle[:32])
        return KVPool.attach(info)

    def close(self) -> None:
        for pool in self._sources.values():
            pool.close()
        self._sources.clear()
