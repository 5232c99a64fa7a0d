"""The global block table: block ids over one or more device pools, who holds each block.

Pool p owns the global ids [base(p), base(p) + num_blocks(p)). A block is in exactly one
state per pool: free (on the free list), cached and unreferenced (held by the prefix cache
alone, evictable), or in use (held by one or more requests, cached or not). Conservation,
checked by `check_invariants`: free + cached_unreferenced + in_use == num_blocks per pool.
Owns: the free lists, holders (reference counts) and cached flags. Does not own: which
token prefix a cached block stores (RadixPrefixCache) or which request wants blocks (Scheduler).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from justapi.scheduler.topology import PoolSpec


class OutOfBlocksError(RuntimeError):
    """allocate() asked for more free blocks than the pool has (callers check num_free first)."""


class BlockPool:
    """Free lists, holders and cached flags of every block of every pool."""

    def __init__(self, pools: Sequence[PoolSpec]) -> None:
        self._bases: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._pool_of: list[int] = []
        self._free: dict[int, list[int]] = {}
        self._holders: dict[int, set[str]] = {}  # block id -> request ids; absent: no holder
        self._is_cached = bytearray()
        self._num_cached: dict[int, int] = {}
        self._num_cached_unreferenced: dict[int, int] = {}
        self._num_in_use: dict[int, int] = {}
        for spec in pools:
            self.add_pool(spec)

    def add_pool(self, spec: PoolSpec) -> None:
        """Append a pool's id range after the existing ones (a late-joining device)."""
        if spec.pool_id in self._sizes:
            raise ValueError(f"pool {spec.pool_id} already exists")
        base = len(self._pool_of)
        self._bases[spec.pool_id] = base
        self._sizes[spec.pool_id] = spec.num_blocks
        self._pool_of.extend([spec.pool_id] * spec.num_blocks)
        self._is_cached.extend(bytes(spec.num_blocks))
        # A stack popped from the end: lowest ids are handed out first.
        self._free[spec.pool_id] = list(range(base + spec.num_blocks - 1, base - 1, -1))
        self._num_cached[spec.pool_id] = 0
        self._num_cached_unreferenced[spec.pool_id] = 0
        self._num_in_use[spec.pool_id] = 0

    # ------------------------------------------------------------------ queries
    @property
    def pool_ids(self) -> list[int]:
        return list(self._sizes)

    def base(self, pool_id: int) -> int:
        """First global block id of the pool: plans carry ids relative to it."""
        return self._bases[pool_id]

    def pool_of(self, block_id: int) -> int:
        return self._pool_of[block_id]

    def num_blocks(self, pool_id: int) -> int:
        return self._sizes[pool_id]

    def num_free(self, pool_id: int) -> int:
        return len(self._free[pool_id])

    def num_cached(self, pool_id: int) -> int:
        return self._num_cached[pool_id]

    def num_cached_unreferenced(self, pool_id: int) -> int:
        return self._num_cached_unreferenced[pool_id]

    def num_in_use(self, pool_id: int) -> int:
        return self._num_in_use[pool_id]

    def num_available(self, pool_id: int) -> int:
        """Free now or after evicting cache entries nobody uses."""
        return len(self._free[pool_id]) + self._num_cached_unreferenced[pool_id]

    def ref_count(self, block_id: int) -> int:
        holders = self._holders.get(block_id)
        return len(holders) if holders else 0

    def holders(self, block_id: int) -> frozenset[str]:
        return frozenset(self._holders.get(block_id, ()))

    def is_sole_holder(self, block_id: int, holder: str) -> bool:
        holders = self._holders.get(block_id)
        return holders is not None and len(holders) == 1 and holder in holders

    def is_cached(self, block_id: int) -> bool:
        return bool(self._is_cached[block_id])

    # ------------------------------------------------------------------ transitions
    def allocate(self, pool_id: int, num_blocks: int, holder: str) -> list[int]:
        """Free -> in use by `holder`."""
        free = self._free[pool_id]
        if num_blocks > len(free):
            raise OutOfBlocksError(f"pool {pool_id}: {num_blocks} blocks asked, {len(free)} free")
        out = [free.pop() for _ in range(num_blocks)]
        holders = self._holders
        for block_id in out:
            holders[block_id] = {holder}
        self._num_in_use[pool_id] += num_blocks
        return out

    def acquire(self, block_id: int, holder: str) -> None:
        """One more holder of a cached or in-use block (prefix sharing)."""
        holders = self._holders.get(block_id)
        if holders is None:
            assert self._is_cached[block_id], f"block {block_id} is free"
            pool_id = self._pool_of[block_id]
            self._num_cached_unreferenced[pool_id] -= 1
            self._num_in_use[pool_id] += 1
            self._holders[block_id] = {holder}
            return
        assert holder not in holders, f"{holder} already holds block {block_id}"
        holders.add(holder)

    def release(self, block_ids: Iterable[int], holder: str) -> None:
        """`holder` drops the blocks; a block nobody holds becomes free, or evictable if cached."""
        all_holders = self._holders
        for block_id in block_ids:
            holders = all_holders[block_id]
            holders.remove(holder)
            if holders:
                continue
            del all_holders[block_id]
            pool_id = self._pool_of[block_id]
            self._num_in_use[pool_id] -= 1
            if self._is_cached[block_id]:
                self._num_cached_unreferenced[pool_id] += 1
            else:
                self._free[pool_id].append(block_id)

    def mark_cached(self, block_id: int) -> None:
        """The prefix cache now also owns an in-use block (it outlives its holders)."""
        assert block_id in self._holders, f"only held blocks are cached, {block_id} is not"
        assert not self._is_cached[block_id], f"block {block_id} is already cached"
        self._is_cached[block_id] = 1
        self._num_cached[self._pool_of[block_id]] += 1

    def evict(self, block_id: int) -> None:
        """Cached and unreferenced -> free (the prefix cache dropped it)."""
        assert self._is_cached[block_id] and block_id not in self._holders, \
            f"block {block_id} is not an unreferenced cached block"
        self._is_cached[block_id] = 0
        pool_id = self._pool_of[block_id]
        self._num_cached[pool_id] -= 1
        self._num_cached_unreferenced[pool_id] -= 1
        self._free[pool_id].append(block_id)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Recount every block (O(blocks): tests only) and compare with the counters."""
        for pool_id, base in self._bases.items():
            size = self._sizes[pool_id]
            free = self._free[pool_id]
            assert len(set(free)) == len(free), f"pool {pool_id}: a block is free twice"
            free_set = set(free)
            counts = {"cached": 0, "cached_unreferenced": 0, "in_use": 0}
            for block_id in range(base, base + size):
                self._check_block(block_id, block_id in free_set, counts)
            assert counts["in_use"] == self._num_in_use[pool_id], f"pool {pool_id}: in_use drift"
            assert counts["cached"] == self._num_cached[pool_id], f"pool {pool_id}: cached drift"
            assert counts["cached_unreferenced"] == self._num_cached_unreferenced[pool_id], \
                f"pool {pool_id}: cached_unreferenced drift"
            total = len(free) + counts["cached_unreferenced"] + counts["in_use"]
            assert total == size, f"pool {pool_id}: free + cached_unreferenced + in_use = {total}" \
                                  f" != {size}"

    def _check_block(self, block_id: int, is_free: bool, counts: dict[str, int]) -> None:
        held = block_id in self._holders
        cached = bool(self._is_cached[block_id])
        assert not (is_free and (held or cached)), f"free block {block_id} is held or cached"
        assert not held or self._holders[block_id], f"block {block_id} has an empty holder set"
        counts["cached"] += cached
        counts["in_use"] += held
        counts["cached_unreferenced"] += cached and not held
        assert is_free or held or cached, f"block {block_id} leaked: not free, held nor cached"
