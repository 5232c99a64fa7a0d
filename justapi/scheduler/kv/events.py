"""KV cache events for cluster routers, in vLLM's terms, from the radix prefix cache.

Each full block the tree caches gets vLLM's block hash: sha256 over the canonical CBOR of
(parent block's hash, the block's token ids, extra keys), the first block's parent being
NONE_HASH = sha256(CBOR(hash seed)) and its extra keys (cache_salt,) when the request had a
salt - vLLM's `sha256_cbor` with PYTHONHASHSEED as the seed, so a router that hashes prompts
itself (llm-d) finds the same keys. Events carry a hash's last 8 bytes as an unsigned int
(vLLM's default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). The tree reports:
  stored(parent block, new blocks, their tokens)  -> BlockStored(hashes, parent hash, tokens)
  removed(blocks)                                 -> BlockRemoved(hashes)
Events are kept per pool until the process shell takes them (one batch per pool and loop
turn, publisher.py). Pure: no sockets, no clocks.
Owns: block hashes of cached blocks, pending events. Does not own: the tree (radix_cache.py).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

MEDIUMS = {"cpu": "CPU", "cuda": "GPU"}
"""A pool's device -> vLLM's `medium` of its blocks."""


def cbor(value: object) -> bytes:
    """Canonical CBOR (RFC 8949 4.2.1) of the values block hashes are made of: ints >= 0,
    bytes, str, None, and tuples/lists of them."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("bool is not part of a block hash")
    if isinstance(value, int):
        if value < 0:
            raise TypeError("negative ints are not part of a block hash")
        return _head(0, value)
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _head(3, len(data)) + data
    if isinstance(value, (tuple, list)):
        return _head(4, len(value)) + b"".join(cbor(item) for item in value)
    raise TypeError(f"{type(value).__name__} is not part of a block hash")


def _head(major: int, length: int) -> bytes:
    """A CBOR item head: major type and argument in the shortest form."""
    if length < 24:
        return bytes([major << 5 | length])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if length < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | code]) + struct.pack(fmt, length)
    raise ValueError(f"{length} does not fit a CBOR head")


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


def external_hash(block_hash: bytes) -> int:
    """What events carry: the hash's low 64 bits (its last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")


class BlockHasher:
    """vLLM's block hash chain."""

    def __init__(self, seed: str) -> None:
        self.none_hash = sha256_cbor(seed)

    def chain(self, parent: bytes | None, tokens: Sequence[int], block_size: int,
              salt: str = "") -> list[bytes]:
        """Hashes of the full blocks of `tokens`, after the block whose hash is `parent`
        (None: the prefix starts at position 0, and `salt` is the first block's extra key)."""
        out: list[bytes] = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            block = tuple(int(t) for t in tokens[start:start + block_size])
            extra = (salt,) if parent is None and salt else None
            parent = sha256_cbor((parent if parent is not None else self.none_hash, block, extra))
            out.append(parent)
        return out


@dataclass
class PoolEvents:
    """One pool's events since they were last taken, as vLLM's event tuples (tag first)."""

    medium: str
    events: list[list] = field(default_factory=list)


class KvEventLog:
    """Hashes of the blocks in the prefix caches and the events not yet published."""

    def __init__(self, block_size: int, seed: str, mediums: dict[int, str]) -> None:
        self.block_size = block_size
        self.hasher = BlockHasher(seed)
        self.pools = {pool_id: PoolEvents(medium) for pool_id, medium in mediums.items()}
        self._hashes: dict[int, dict[int, bytes]] = {pool_id: {} for pool_id in mediums}

    def stored(self, pool_id: int, parent_block_id: int | None, block_ids: Sequence[int],
               tokens: Sequence[int], salt: str) -> None:
        """The tree cached block_ids (holding `tokens`) after parent_block_id (None: from
        position 0)."""
        hashes = self._hashes[pool_id]
        parent = hashes[parent_block_id] if parent_block_id is not None else None
        chain = self.hasher.chain(parent, tokens, self.block_size, salt)
        for block_id, block_hash in zip(block_ids, chain, strict=True):
            hashes[block_id] = block_hash
        pool = self.pools[pool_id]
        pool.events.append(["BlockStored", [external_hash(h) for h in chain],
                            external_hash(parent) if parent is not None else None,
                            [int(t) for t in tokens], self.block_size, None, pool.medium, None])

    def removed(self, pool_id: int, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        hashes = self._hashes[pool_id]
        pool = self.pools[pool_id]
        pool.events.append(["BlockRemoved", [external_hash(hashes.pop(b)) for b in block_ids],
                            pool.medium])

    def take(self) -> list[tuple[int, list[list]]]:
        """(pool id, events) of every pool with news, oldest first; clears them."""
        out = []
        for pool_id, pool in self.pools.items():
            if pool.events:
                out.append((pool_id, pool.events))
                pool.events = []
        return out

    def cached_hashes(self, pool_id: int) -> set[int]:
        """External hashes of the blocks cached now (tests compare routers' views with it)."""
        return {external_hash(h) for h in self._hashes[pool_id].values()}
