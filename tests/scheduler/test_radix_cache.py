"""RadixPrefixCache: match / split / insert / LRU evict / flush with exact block accounting."""
from __future__ import annotations

import array
import random

import pytest

from justapi.scheduler.kv.block_pool import BlockPool
from justapi.scheduler.kv.radix_cache import RadixPrefixCache
from justapi.scheduler.topology import PoolSpec

BS = 4  # tokens per block in these tests


def tok(values: list[int]) -> bytes:
    return array.array("i", values).tobytes()


def blocks_of(n: int, base: int = 0) -> list[int]:
    """n blocks' worth of distinct tokens."""
    return list(range(base, base + n * BS))


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool([PoolSpec(0, 32)])


@pytest.fixture
def cache(pool: BlockPool) -> RadixPrefixCache:
    return RadixPrefixCache(pool, 0, BS)


def check(pool: BlockPool, cache: RadixPrefixCache) -> None:
    pool.check_invariants()
    cache.check_invariants()


def insert_held(pool, cache, holder, tokens, salt=""):
    ids = pool.allocate(0, len(tokens) // BS, holder)
    ins = cache.insert(tok(tokens), ids, salt, holder)
    return ids, ins


def test_insert_then_match_full_partial_and_capped(pool, cache):
    tokens = blocks_of(3)
    ids, ins = insert_held(pool, cache, "a", tokens)
    assert ins.block_ids == ids and cache.num_blocks == 3
    assert cache.match(tok(tokens), "", 3).block_ids == ids
    assert cache.match(tok(tokens[:9]), "", 3).block_ids == ids[:2]  # only full blocks match
    assert cache.match(tok(tokens), "", 1).block_ids == ids[:1]  # max_blocks caps
    assert cache.match(tok([999] + tokens[1:]), "", 3).block_ids == []
    check(pool, cache)


def test_salts_never_share(pool, cache):
    tokens = blocks_of(2)
    insert_held(pool, cache, "a", tokens, salt="tenant-1")
    assert cache.match_length(tok(tokens), "tenant-2", 2) == 0
    assert cache.match_length(tok(tokens), "", 2) == 0
    assert cache.match_length(tok(tokens), "tenant-1", 2) == 2


def test_partial_match_splits_node_and_keeps_deep_handle(pool, cache):
    tokens = blocks_of(4)
    ids, ins = insert_held(pool, cache, "a", tokens)
    deep = ins.node
    assert cache.num_nodes == 1
    other = tokens[:8] + blocks_of(1, base=500)
    assert cache.match_length(tok(other), "", 3) == 2  # probes never split
    assert cache.num_nodes == 1
    match = cache.match(tok(other), "", 3)
    assert match.block_ids == ids[:2] and cache.num_nodes == 2
    assert deep.end_block == 4 and deep.start_block == 2 and deep.parent is match.node
    for b in match.block_ids:  # holding a split node keeps holders uniform per node
        pool.acquire(b, "b")
    check(pool, cache)


def test_insert_returns_cached_ids_for_duplicates(pool, cache):
    tokens = blocks_of(2)
    ids_a, _ = insert_held(pool, cache, "a", tokens)
    ids_b = pool.allocate(0, 3, "b")  # b computed the same 2 blocks itself, plus one more
    ins = cache.insert(tok(tokens + blocks_of(1, 100)), ids_b, "", "b")
    assert ins.block_ids == ids_a + [ids_b[2]]
    for own, cached in zip(ids_b, ins.block_ids):  # the caller adopts and frees duplicates
        if own != cached:
            pool.acquire(cached, "b")
            pool.release([own], "b")
    assert pool.num_free(0) == 32 - 3 and cache.num_blocks == 3
    check(pool, cache)


def test_sole_holder_extends_leaf_in_place(pool, cache):
    tokens = blocks_of(5)
    ids = pool.allocate(0, 5, "a")
    first = cache.insert(tok(tokens), ids[:2], "", "a")
    second = cache.insert(tok(tokens), ids[:5], "", "a", start=first.node)
    assert second.node is first.node and second.block_ids == ids[2:5]
    assert cache.num_nodes == 1 and first.node.end_block == 5
    check(pool, cache)
    pool.acquire(ids[0], "b")  # b holding part of a node without a split breaks uniformity
    with pytest.raises(AssertionError, match="holders differ"):
        cache.check_invariants()


def test_shared_leaf_gets_a_child_instead_of_extending(pool, cache):
    tokens = blocks_of(3)
    ids = pool.allocate(0, 3, "a")
    first = cache.insert(tok(tokens), ids[:1], "", "a")
    pool.acquire(ids[0], "b")
    second = cache.insert(tok(tokens), ids, "", "a", start=first.node)
    assert second.node.parent is first.node and cache.num_nodes == 2
    check(pool, cache)


def test_lru_eviction_takes_oldest_leaf_tail_first(pool, cache):
    ids_a, ins_a = insert_held(pool, cache, "a", blocks_of(3, 0))
    ids_b, ins_b = insert_held(pool, cache, "b", blocks_of(2, 1000))
    pool.release(ids_a, "a")
    cache.release_path(ins_a.node)  # a used less recently than b
    pool.release(ids_b, "b")
    cache.release_path(ins_b.node)
    assert pool.num_cached_unreferenced(0) == 5
    assert cache.evict(2) == 2
    assert cache.match(tok(blocks_of(3, 0)), "", 3).block_ids == ids_a[:1]  # a lost its tail
    assert cache.match_length(tok(blocks_of(2, 1000)), "", 2) == 2
    assert pool.num_free(0) == 32 - 3
    check(pool, cache)


def test_referenced_blocks_are_never_evicted_and_flush_frees_only_unreferenced(pool, cache):
    shared = blocks_of(2)
    ids_a, ins_a = insert_held(pool, cache, "a", shared + blocks_of(1, 100))
    ids_b = [*ids_a[:2], *pool.allocate(0, 1, "b")]
    for b in ids_a[:2]:
        pool.acquire(b, "b")
    cache.match(tok(shared + blocks_of(1, 200)), "", 3)  # splits a's node at 2 blocks
    ins_b = cache.insert(tok(shared + blocks_of(1, 200)), ids_b, "", "b")
    pool.release(ids_a, "a")
    cache.release_path(ins_a.node)
    assert cache.evict(10) == 1  # only a's private tail; the shared 2 are held by b
    assert cache.flush() == 0
    pool.release(ids_b, "b")
    cache.release_path(ins_b.node)
    assert cache.flush() == 3  # b's leaf, then the shared parent it exposed
    assert cache.num_blocks == 0 and cache.num_nodes == 0 and pool.num_free(0) == 32
    check(pool, cache)


def test_stats_count_blocks_and_tokens(pool, cache):
    cache.record_lookup(num_query_blocks=4, num_hit_blocks=3, num_query_tokens=17)
    cache.record_lookup(num_query_blocks=2, num_hit_blocks=0, num_query_tokens=9)
    assert (cache.stats.hits, cache.stats.misses) == (3, 3)
    assert cache.stats.hit_ratio == pytest.approx(0.5)
    assert (cache.stats.query_tokens, cache.stats.hit_tokens) == (26, 12)


def test_random_insert_release_evict_keeps_exact_accounting():
    rng = random.Random(7)
    pool = BlockPool([PoolSpec(0, 64)])
    cache = RadixPrefixCache(pool, 0, BS)
    held: dict[str, tuple[list[int], object]] = {}
    for step in range(400):
        if held and (rng.random() < 0.45 or pool.num_available(0) < 8):
            name = rng.choice(sorted(held))
            ids, node = held.pop(name)
            pool.release(ids, name)
            if node is not None:
                cache.release_path(node)
        else:
            name = f"r{step}"
            n = rng.randint(1, 6)
            tokens = [rng.randint(0, 2) for _ in range(n * BS)]  # tiny alphabet: many shares
            match = cache.match(tok(tokens), "", n)
            for b in match.block_ids:
                pool.acquire(b, name)
            need = n - match.num_blocks
            if need > pool.num_free(0):
                cache.evict(need - pool.num_free(0))
            own = match.block_ids + pool.allocate(0, need, name)
            ins = cache.insert(tok(tokens), own, "", name, start=match.node)
            assert ins.block_ids == own[match.num_blocks:]
            held[name] = (own, ins.node)
        check(pool, cache)
    for name, (ids, node) in held.items():
        pool.release(ids, name)
        if node is not None:
            cache.release_path(node)
    cache.flush()
    assert pool.num_free(0) == 64 and cache.num_nodes == 0
