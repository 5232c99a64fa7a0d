"""One node of the radix prefix tree: a run of full blocks and the tokens they store.

Tokens are kept as int32 little-endian bytes (`TOKEN_BYTES` per token), so comparing a
node's run with a request's prefix is one bytes comparison. A node covers the blocks
[start_block, end_block) of every prefix that passes through it.
Owns: the node's fields and split/extend/truncate. Does not own: holders (BlockPool),
LRU order and accounting (RadixPrefixCache).
"""
from __future__ import annotations

import array

TOKEN_BYTES = 4
assert array.array("i").itemsize == TOKEN_BYTES, "token arrays must be int32"


class RadixNode:
    """Blocks [start_block, end_block) of some cached prefixes; children keyed by first block."""

    __slots__ = ("tokens", "block_ids", "children", "parent", "start_block", "last_access",
                 "key", "is_alive")

    def __init__(self, tokens: bytes, block_ids: list[int], parent: RadixNode | None,
                 start_block: int, key: bytes) -> None:
        self.tokens = tokens  # int32 bytes of len(block_ids) * block_size tokens
        self.block_ids = block_ids
        self.children: dict[bytes, RadixNode] = {}
        self.parent = parent
        self.start_block = start_block
        self.last_access = 0
        self.key = key  # bytes of the first block's tokens: the key in parent.children
        self.is_alive = True

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def end_block(self) -> int:
        return self.start_block + len(self.block_ids)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def split(self, num_blocks: int, block_bytes: int) -> RadixNode:
        """Cut after `num_blocks` blocks; return the new parent holding the first part.

        This node object keeps the tail (so a handle to the deepest node stays valid)."""
        assert 0 < num_blocks < len(self.block_ids) and self.parent is not None
        cut = num_blocks * block_bytes
        head = RadixNode(self.tokens[:cut], self.block_ids[:num_blocks], self.parent,
                         self.start_block, self.key)
        head.last_access = self.last_access
        self.parent.children[self.key] = head
        self.tokens = self.tokens[cut:]
        self.block_ids = self.block_ids[num_blocks:]
        self.start_block += num_blocks
        self.key = self.tokens[:block_bytes]
        self.parent = head
        head.children[self.key] = self
        return head

    def extend(self, tokens: bytes, block_ids: list[int]) -> None:
        """Append blocks at the end (the leaf's only holder grew its prefix)."""
        self.tokens += tokens
        self.block_ids.extend(block_ids)

    def truncate(self, num_blocks: int, block_bytes: int) -> list[int]:
        """Drop the last `num_blocks` blocks (partial eviction); return their ids."""
        assert 0 < num_blocks < len(self.block_ids)
        dropped = self.block_ids[-num_blocks:]
        del self.block_ids[-num_blocks:]
        self.tokens = self.tokens[:len(self.block_ids) * block_bytes]
        return dropped

    def path_to_root(self) -> list[RadixNode]:
        out = []
        node: RadixNode | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out
