"""Block-aligned radix tree over token ids -> cached block ids, for one pool.

Only full, computed blocks are cached. A tree per `cache_salt` (model, adapter, tenant), so
different salts never share entries; sampling parameters never enter the key. Requests
"lock" a path by holding its blocks in the BlockPool: every block of a node has the same
holders (a partial match splits the node first), and a child's holders are a subset of its
parent's, so a node is evictable exactly when it is a leaf whose blocks nobody holds.
Eviction takes the least recently used such leaves, tail blocks first.
Owns: the tree, its LRU heap and lookup statistics. Does not own: allocation or holders
(BlockPool), which request holds which path (KvCacheManager).
"""
from __future__ import annotations

import array
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from justapi.scheduler.kv.block_pool import BlockPool
from justapi.scheduler.kv.events import KvEventLog
from justapi.scheduler.kv.radix_node import TOKEN_BYTES, RadixNode


@dataclass
class Match:
    """The longest cached prefix: its deepest node (None when nothing matched) and blocks."""

    node: RadixNode | None
    block_ids: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class Insertion:
    """After insert: the deepest node of the prefix (None if it has no full block) and the
    cached ids of the inserted range."""

    node: RadixNode | None
    block_ids: list[int]


@dataclass
class PrefixCacheStats:
    """Lookups counted in blocks (hits/misses) and in tokens (vLLM-style queries/hits)."""

    hits: int = 0
    misses: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_ratio(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0


class RadixPrefixCache:
    """Block-aligned token prefixes -> block ids, with LRU eviction of unreferenced leaves."""

    def __init__(self, pool: BlockPool, pool_id: int, block_size: int) -> None:
        self._pool = pool
        self.pool_id = pool_id
        self.block_size = block_size
        self._block_bytes = block_size * TOKEN_BYTES
        self._roots: dict[str, RadixNode] = {}
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_access, push order, leaf)
        self._tick = 0
        self._num_pushes = 0
        self._num_nodes = 0
        self.stats = PrefixCacheStats()
        self.events: KvEventLog | None = None  # --kv-events: blocks stored / removed (events.py)

    @property
    def num_blocks(self) -> int:
        return self._pool.num_cached(self.pool_id)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    # ------------------------------------------------------------------ lookups
    def match_length(self, tokens: bytes, salt: str, max_blocks: int) -> int:
        """Blocks of the longest cached prefix, read-only (routing and lpm probes)."""
        return self._walk(tokens, salt, max_blocks, split=False)[1]

    def match(self, tokens: bytes, salt: str, max_blocks: int) -> Match:
        """Longest cached prefix of at most max_blocks blocks, ending on a node boundary."""
        node, _, block_ids = self._walk(tokens, salt, max_blocks, split=True)
        return Match(node if block_ids else None, block_ids)

    def record_lookup(self, num_query_blocks: int, num_hit_blocks: int, num_query_tokens: int) -> None:
        self.stats.hits += num_hit_blocks
        self.stats.misses += num_query_blocks - num_hit_blocks
        self.stats.query_tokens += num_query_tokens
        self.stats.hit_tokens += num_hit_blocks * self.block_size

    def _walk(self, tokens: bytes, salt: str, max_blocks: int,
              split: bool) -> tuple[RadixNode | None, int, list[int]]:
        bb = self._block_bytes
        node, depth = self._roots.get(salt), 0
        block_ids: list[int] = []
        if node is None:
            return None, 0, []
        max_blocks = min(max_blocks, len(tokens) // bb)
        while depth < max_blocks:
            child = node.children.get(tokens[depth * bb:(depth + 1) * bb])
            if child is None:
                break
            n = self._common_blocks(child, tokens, depth, max_blocks - depth)
            if n < child.num_blocks:
                if not split:
                    return node, depth + n, block_ids
                child = child.split(n, bb)
                self._num_nodes += 1
            block_ids.extend(child.block_ids)
            node, depth = child, depth + n
        return node, depth, block_ids

    def _common_blocks(self, node: RadixNode, tokens: bytes, depth: int, limit: int) -> int:
        """How many of node's blocks equal tokens' blocks from `depth` (the first always does)."""
        bb = self._block_bytes
        n = min(node.num_blocks, limit)
        lo = depth * bb
        if node.tokens[:n * bb] == tokens[lo:lo + n * bb]:
            return n
        k = 1
        while k < n and node.tokens[k * bb:(k + 1) * bb] == tokens[lo + k * bb:lo + (k + 1) * bb]:
            k += 1
        return k

    def _root(self, salt: str) -> RadixNode:
        root = self._roots.get(salt)
        if root is None:
            root = RadixNode(b"", [], None, 0, salt.encode())
            self._roots[salt] = root
        return root

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: bytes, block_ids: Sequence[int], salt: str, holder: str,
               start: RadixNode | None = None) -> Insertion:
        """Cache the full blocks of a prefix that `holder` holds and has computed.

        tokens/block_ids cover the prefix from position 0; `start` (a node on this prefix,
        e.g. the holder's deepest cached node) skips the walk over what is already cached.
        Returns the cached ids of blocks [start.end_block, len(block_ids)): where one differs
        from the caller's, the caller's block duplicates a cached one and the caller should
        hold the cached id instead and release its own."""
        bb = self._block_bytes
        total = min(len(block_ids), len(tokens) // bb)
        if total <= (start.end_block if start is not None else 0):
            return Insertion(start, [])
        node = start if start is not None else self._root(salt)
        depth = node.end_block
        cached: list[int] = []
        self._tick += 1
        while depth < total:
            child = node.children.get(tokens[depth * bb:(depth + 1) * bb])
            if child is None:
                if self.events is not None:
                    self._stored(node, tokens, block_ids[depth:total], salt)
                node = self._grow(node, tokens, list(block_ids[depth:total]), holder)
                cached.extend(block_ids[depth:total])
                break
            n = self._common_blocks(child, tokens, depth, total - depth)
            if n < child.num_blocks:
                child = child.split(n, bb)
                self._num_nodes += 1
            cached.extend(child.block_ids)
            node, depth = child, depth + n
        node.last_access = self._tick
        return Insertion(node, cached)

    def _stored(self, node: RadixNode, tokens: bytes, new_ids: Sequence[int], salt: str) -> None:
        """Report blocks about to be cached below `node` (events.py)."""
        assert self.events is not None
        bb = self._block_bytes
        run = tokens[node.end_block * bb:(node.end_block + len(new_ids)) * bb]
        parent = None if node.is_root else node.block_ids[-1]
        self.events.stored(self.pool_id, parent, new_ids, array.array("i", run).tolist(), salt)

    def _grow(self, node: RadixNode, tokens: bytes, new_ids: list[int], holder: str) -> RadixNode:
        """New blocks below `node`: extend it in place when `holder` alone uses that leaf
        (keeps decode chains one node deep), else hang a new leaf under it."""
        bb = self._block_bytes
        depth = node.end_block
        run = tokens[depth * bb:(depth + len(new_ids)) * bb]
        for block_id in new_ids:
            self._pool.mark_cached(block_id)
        if (not node.is_root and node.is_leaf
                and self._pool.is_sole_holder(node.block_ids[0], holder)):
            node.extend(run, new_ids)
            return node
        child = RadixNode(run, new_ids, node, depth, run[:bb])
        node.children[child.key] = child
        self._num_nodes += 1
        return child

    # ------------------------------------------------------------------ release / evict
    def release_path(self, node: RadixNode) -> None:
        """A holder of the path ending at `node` let go: stamp it most recently used, and
        queue the node for eviction if nobody holds it now."""
        self._tick += 1
        for on_path in node.path_to_root():
            on_path.last_access = self._tick
        self._maybe_push(node)

    def evict(self, num_blocks: int) -> int:
        """Free up to num_blocks unreferenced cached blocks, least recently used leaves first."""
        freed = 0
        heap = self._heap
        while freed < num_blocks and heap:
            stamp, _, node = heap[0]
            if not self._is_evictable(node, stamp):
                heapq.heappop(heap)
                continue
            take = min(node.num_blocks, num_blocks - freed)
            if take < node.num_blocks:
                dropped = node.truncate(take, self._block_bytes)
            else:
                heapq.heappop(heap)
                dropped = node.block_ids
                self._remove(node)
            for block_id in dropped:
                self._pool.evict(block_id)
            if self.events is not None:
                self.events.removed(self.pool_id, dropped)
            freed += len(dropped)
        return freed

    def flush(self) -> int:
        """Evict every unreferenced block; blocks in use stay cached. Returns blocks freed."""
        return self.evict(self._pool.num_cached_unreferenced(self.pool_id))

    def _remove(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        node.is_alive = False
        self._num_nodes -= 1
        if parent.is_root:
            if not parent.children:
                del self._roots[parent.key.decode()]
        else:
            self._maybe_push(parent)

    def _is_evictable(self, node: RadixNode, stamp: int) -> bool:
        return (node.is_alive and not node.children and node.last_access == stamp
                and self._pool.ref_count(node.block_ids[0]) == 0)

    def _maybe_push(self, node: RadixNode) -> None:
        if node.is_root or node.children or self._pool.ref_count(node.block_ids[0]):
            return
        self._num_pushes += 1
        heapq.heappush(self._heap, (node.last_access, self._num_pushes, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries (amortised: runs once the heap doubles the live nodes)."""
        self._heap = [entry for entry in self._heap if self._is_evictable(entry[2], entry[0])]
        heapq.heapify(self._heap)

    # ------------------------------------------------------------------ invariants
    def nodes(self) -> list[RadixNode]:
        """Every non-root node (O(nodes): tests and invariants only)."""
        out: list[RadixNode] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_invariants(self) -> None:
        nodes = self.nodes()
        assert len(nodes) == self._num_nodes, f"{len(nodes)} nodes, counter says {self._num_nodes}"
        queued = {(id(node), stamp) for stamp, _, node in self._heap}
        seen: set[int] = set()
        for node in nodes:
            self._check_node(node)
            for block_id in node.block_ids:
                assert block_id not in seen, f"block {block_id} cached twice"
                seen.add(block_id)
            if self._is_evictable(node, node.last_access):
                assert (id(node), node.last_access) in queued, "an evictable leaf is not queued"
        assert len(seen) == self._pool.num_cached(self.pool_id), \
            f"tree holds {len(seen)} blocks, pool counts {self._pool.num_cached(self.pool_id)} cached"
        for salt, root in self._roots.items():
            assert root.is_root and root.key == salt.encode() and root.children, f"bad root {salt!r}"

    def _check_node(self, node: RadixNode) -> None:
        bb = self._block_bytes
        parent = node.parent
        assert node.is_alive and parent is not None and parent.children.get(node.key) is node
        assert node.num_blocks >= 1 and len(node.tokens) == node.num_blocks * bb
        assert node.key == node.tokens[:bb] and node.start_block == parent.end_block
        holders = self._pool.holders(node.block_ids[0])
        for block_id in node.block_ids:
            assert self._pool.is_cached(block_id), f"tree block {block_id} not marked cached"
            assert self._pool.pool_of(block_id) == self.pool_id, f"block {block_id} wrong pool"
            assert self._pool.holders(block_id) == holders, f"node holders differ at {block_id}"
        if not parent.is_root:
            assert holders <= self._pool.holders(parent.block_ids[0]), "child held, parent not"
