"""BlockPool: global ids over several pools, holders, cached flags, conservation."""
from __future__ import annotations

import pytest

from justapi.scheduler.kv.block_pool import BlockPool, OutOfBlocksError
from justapi.scheduler.topology import PoolSpec


def counts(pool: BlockPool, pool_id: int) -> tuple[int, int, int]:
    return (pool.num_free(pool_id), pool.num_cached_unreferenced(pool_id), pool.num_in_use(pool_id))


def test_global_ids_span_pools():
    pool = BlockPool([PoolSpec(3, 4), PoolSpec(7, 2)])
    assert pool.base(3) == 0 and pool.base(7) == 4
    assert [pool.pool_of(b) for b in range(6)] == [3, 3, 3, 3, 7, 7]
    assert pool.allocate(7, 2, "a") == [4, 5]
    assert pool.allocate(3, 1, "a") == [0]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(7, 1, "b")
    pool.check_invariants()


def test_refcounts_and_state_transitions():
    pool = BlockPool([PoolSpec(0, 4)])
    (b,) = pool.allocate(0, 1, "r1")
    assert counts(pool, 0) == (3, 0, 1) and pool.ref_count(b) == 1
    pool.mark_cached(b)
    pool.acquire(b, "r2")
    assert pool.ref_count(b) == 2 and pool.holders(b) == {"r1", "r2"}
    pool.release([b], "r1")
    assert counts(pool, 0) == (3, 0, 1)
    pool.release([b], "r2")  # cached, nobody holds it: evictable, not free
    assert counts(pool, 0) == (3, 1, 0) and pool.is_cached(b)
    pool.acquire(b, "r3")  # a cache hit revives it
    assert counts(pool, 0) == (3, 0, 1)
    pool.release([b], "r3")
    pool.evict(b)
    assert counts(pool, 0) == (4, 0, 0) and not pool.is_cached(b)
    pool.check_invariants()


def test_uncached_block_is_freed_on_last_release():
    pool = BlockPool([PoolSpec(0, 2)])
    blocks = pool.allocate(0, 2, "r")
    pool.release(blocks, "r")
    assert counts(pool, 0) == (2, 0, 0)
    pool.check_invariants()


def test_misuse_is_caught():
    pool = BlockPool([PoolSpec(0, 2)])
    (b,) = pool.allocate(0, 1, "r")
    with pytest.raises(AssertionError):
        pool.acquire(b, "r")  # holds it already
    with pytest.raises(AssertionError):
        pool.evict(b)  # in use, not cached
    with pytest.raises(AssertionError):
        pool.acquire(1, "x")  # a free block cannot be shared
    with pytest.raises(ValueError):
        pool.add_pool(PoolSpec(0, 3))


def test_check_invariants_detects_drift():
    pool = BlockPool([PoolSpec(0, 3)])
    pool.allocate(0, 1, "r")
    pool._num_in_use[0] += 1  # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match="in_use drift"):
        pool.check_invariants()


def test_check_invariants_detects_leak():
    pool = BlockPool([PoolSpec(0, 3)])
    pool._free[0].pop()  # a block vanishes from every state
    with pytest.raises(AssertionError):
        pool.check_invariants()
