"""Block accounting of requests: prefix reuse, allocation with eviction, caching, release.

The one place that moves blocks between a request (or a KV hand-off's holder) and the
BlockPool / RadixPrefixCache, so Scheduler and PdScheduler share it instead of copying it. A request holds
block_ids[i] for tokens [i * block_size, (i + 1) * block_size); the first num_cached_blocks
of them are the path to its cache_node in its pool's tree.
Owns: those transitions. Does not own: when they happen (the scheduler's policy).
"""
from __future__ import annotations

from collections.abc import Sequence

from justapi.scheduler.kv.block_pool import BlockPool
from justapi.scheduler.kv.radix_cache import Match, RadixPrefixCache
from justapi.scheduler.kv.radix_node import RadixNode
from justapi.scheduler.request import Request


class KvCacheManager:
    """Moves blocks between requests, the pools and the per-pool prefix caches."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_cache: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.caches: dict[int, RadixPrefixCache] = {}
        for pool_id in pool.pool_ids:
            self.add_pool(pool_id)

    def add_pool(self, pool_id: int) -> None:
        self.caches[pool_id] = RadixPrefixCache(self.pool, pool_id, self.block_size)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix reuse
    def probe(self, pool_id: int, tokens: bytes, salt: str, num_tokens: int) -> int:
        """Cached prefix blocks a request with these tokens would get in this pool (read-only)."""
        if not self.enable_prefix_cache:
            return 0
        return self.caches[pool_id].match_length(tokens, salt, (num_tokens - 1) // self.block_size)

    def match_prefix(self, req: Request) -> int:
        """Admission: hold the longest cached prefix; it counts as computed. Returns its blocks.

        At most (num_tokens - 1) // block_size blocks: at least the last known token is
        always computed, so the step has logits to sample from."""
        assert not req.block_ids and req.num_computed_tokens == 0
        if not self.enable_prefix_cache or req.needs_every_position:
            return 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        match = self.hold_prefix(req.pool_id, req.token_bytes(), req.cache_salt, max_blocks,
                                 req.request_id)
        req.block_ids.extend(match.block_ids)
        req.cache_node = match.node
        req.num_cached_blocks = match.num_blocks
        req.num_computed_tokens = match.num_blocks * self.block_size
        return match.num_blocks

    def hold_prefix(self, pool_id: int, tokens: bytes, salt: str, max_blocks: int,
                    holder: str) -> Match:
        """`holder` holds the longest cached prefix (at most max_blocks blocks) of tokens."""
        if not self.enable_prefix_cache:
            return Match(None, [])
        match = self.caches[pool_id].match(tokens, salt, max_blocks)
        for block_id in match.block_ids:
            self.pool.acquire(block_id, holder)
        return match

    def record_lookup(self, req: Request, num_hit_blocks: int) -> None:
        """Count an admission's lookup (only admissions count, not probes or retries)."""
        if self.enable_prefix_cache:
            max_blocks = (req.num_tokens - 1) // self.block_size
            self.caches[req.pool_id].record_lookup(max_blocks, num_hit_blocks, req.num_tokens)

    # ------------------------------------------------------------------ allocation
    def num_new_blocks(self, req: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) - len(req.block_ids)

    def can_allocate(self, pool_id: int, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_available(pool_id)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Give req blocks for its first num_tokens tokens, evicting cache leaves if needed.
        All or nothing: False (and no change) when the pool cannot supply them."""
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        block_ids = self.allocate_blocks(req.pool_id, need, req.request_id)
        if block_ids is None:
            return False
        req.block_ids.extend(block_ids)
        return True

    def allocate_blocks(self, pool_id: int, num_blocks: int, holder: str) -> list[int] | None:
        """num_blocks free blocks of the pool for holder, evicting cache leaves if needed;
        None (and no change) when the pool cannot supply them."""
        free = self.pool.num_free(pool_id)
        if num_blocks > free:
            if num_blocks > free + self.pool.num_cached_unreferenced(pool_id):
                return None
            self.caches[pool_id].evict(num_blocks - free)
        return self.pool.allocate(pool_id, num_blocks, holder)

    # ------------------------------------------------------------------ caching / release
    def cache_computed(self, req: Request, num_written: int | None = None,
                       deferred: list[tuple[int, str]] | None = None) -> None:
        """Insert the request's newly full computed blocks into its pool's tree: those below
        num_written (default num_computed_tokens; with overlap a step in flight has not
        written its positions yet).

        Where another request cached the same block first, adopt the cached block and free
        our duplicate (same tokens at the same positions after the same prefix = same KV) -
        or, with `deferred`, hand it to that list (a step in flight may still read it)."""
        written = req.num_computed_tokens if num_written is None else num_written
        full = written // self.block_size
        if not self.enable_prefix_cache or full <= req.num_cached_blocks:
            return
        start = req.num_cached_blocks
        insertion = self.caches[req.pool_id].insert(
            req.token_bytes(), req.block_ids[:full], req.cache_salt, req.request_id,
            start=req.cache_node)
        rid = req.request_id
        for index, cached_id in enumerate(insertion.block_ids, start):
            own_id = req.block_ids[index]
            if own_id != cached_id:
                self.pool.acquire(cached_id, rid)
                if deferred is None:
                    self.pool.release((own_id,), rid)
                else:
                    deferred.append((own_id, rid))
                req.block_ids[index] = cached_id
        req.cache_node = insertion.node
        req.num_cached_blocks = full

    def free(self, req: Request) -> None:
        """Release every block the request holds; its cached path becomes evictable."""
        self.release(req.pool_id, req.block_ids, req.cache_node, req.request_id)
        del req.block_ids[:]
        req.cache_node = None
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0

    def release(self, pool_id: int, block_ids: Sequence[int], node: RadixNode | None,
                holder: str) -> None:
        """holder lets go of blocks whose cached prefix (if any) ends at node."""
        self.pool.release(block_ids, holder)
        if node is not None:
            self.caches[pool_id].release_path(node)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep blocks for the first num_tokens tokens only (speculative rollback): the freed
        blocks held nothing but rejected draft tokens."""
        keep = -(-num_tokens // self.block_size)
        assert keep >= req.num_cached_blocks, "rollback below cached (verified) blocks"
        if keep < len(req.block_ids):
            self.pool.release(req.block_ids[keep:], req.request_id)
            del req.block_ids[keep:]
