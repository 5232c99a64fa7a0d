"""A deterministic stand-in for a language model whose output depends on the KV cache as
read back through block tables - so scheduling mistakes change tokens.

A KV slot stores (token, position, prefix hash). The prefix hash of position p chains the
hash stored at position p - 1 with token p, like real K/V that depend on the whole prefix.
The next token after position p is a hash of every entry read back for positions [0, p]:
a wrong block table, a block shared between different prefixes, or a block freed while in
use and then overwritten changes the token (or trips a position check in FakeWorker).
`ReferenceModel` computes the same function from a plain token list, with no paging.
LongRoPE (a `long_rope_context`): an entry computed with the long table hashes differently
(`mix_row`); the reference picks the table as transformers' generate() does for Phi-3 (the
whole cache recomputed with the long table once the sequence outgrows that context).
Owns: the fake model function and the fake KV store. Does not own: plan checking (fake_worker).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MASK = (1 << 64) - 1
SEED_HASH = 0x243F6A8885A308D3  # the "hash before position 0"


def mix(prev_hash: int, token: int, position: int) -> int:
    """Prefix hash of `position` from the previous position's hash (splitmix64 finish)."""
    x = (prev_hash ^ ((token + 1) * 0x9E3779B97F4A7C15) ^ (position * 0xBF58476D1CE4E5B9)) & MASK
    x = ((x ^ (x >> 31)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 29)


LONG_TABLE_TAG = 0x9E6C63D0676A9A99  # LongRoPE: what the long table changes in an entry


def mix_row(prev_hash: int, token: int, position: int, is_long: bool) -> int:
    """mix(), for an entry computed with LongRoPE's long table (is_long) or the short one."""
    return mix(prev_hash ^ LONG_TABLE_TAG if is_long else prev_hash, token, position)


def next_token(tokens: np.ndarray, hashes: np.ndarray, vocab_size: int,
               allowed: np.ndarray | None = None) -> int:
    """The model: tokens/hashes are the entries for positions [0, p], in order. `allowed`
    (the token ids a structured output's mask leaves, ascending) narrows the pick to them."""
    n = len(hashes)
    weights = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        checksum = int(np.sum(hashes * weights + tokens.astype(np.uint64), dtype=np.uint64))
    value = mix(int(hashes[-1]), checksum & 0xFFFFFFFF, n)
    if allowed is None:
        return value % vocab_size
    if not len(allowed):
        raise ValueError("the mask allows no token")
    return int(allowed[value % len(allowed)])


POOLED_SIZE = 4


def pooled_state(last_hash: int) -> np.ndarray:
    """The fake model's pooled hidden state of a prompt: float32 [POOLED_SIZE], read from the
    prefix hash of its last position (so it depends on every KV entry before it)."""
    return np.asarray([(int(last_hash) >> (16 * k)) & 0xFFFF for k in range(POOLED_SIZE)],
                      dtype=np.float32)


def allowed_ids(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids a bitmask row (int32 words, bit b of word w = token 32 w + b) allows."""
    bits = np.unpackbits(np.ascontiguousarray(mask_row).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


class ReferenceModel:
    """The fake model evaluated densely over a token list: what any schedule must produce."""

    def __init__(self, vocab_size: int, long_rope_context: int = 0) -> None:
        self.vocab_size = vocab_size
        self.long_rope_context = long_rope_context  # 0: no LongRoPE

    def is_long(self, num_tokens: int) -> bool:
        """One forward over num_tokens tokens takes the long table (transformers' rule)."""
        return 0 < self.long_rope_context < num_tokens

    def chain(self, token_ids: Sequence[int]) -> list[int]:
        """Entries of one forward over the whole sequence (its table by its length)."""
        out, h = [], SEED_HASH
        is_long = self.is_long(len(token_ids))
        for position, token in enumerate(token_ids):
            h = mix_row(h, int(token), position, is_long)
            out.append(h)
        return out

    def next_token(self, token_ids: Sequence[int], allowed: np.ndarray | None = None) -> int:
        hashes = np.array(self.chain(token_ids), dtype=np.uint64)
        return next_token(np.asarray(token_ids, dtype=np.int64), hashes, self.vocab_size, allowed)

    def generate(self, prompt: Sequence[int], max_tokens: int, stop_ids: frozenset[int],
                 max_len: int) -> tuple[list[int], str]:
        """Greedy continuation under the scheduler's finish rules -> (output, reason)."""
        tokens = [int(t) for t in prompt]
        hashes = self.chain(tokens)
        output: list[int] = []
        while True:
            token = next_token(np.asarray(tokens, dtype=np.int64),
                               np.array(hashes, dtype=np.uint64), self.vocab_size)
            tokens.append(token)
            if len(tokens) == self.long_rope_context + 1:  # generate(): the cache recomputed
                hashes = self.chain(tokens)
            else:
                hashes.append(mix_row(hashes[-1], token, len(tokens) - 1, self.is_long(len(tokens))))
            output.append(token)
            if token in stop_ids:
                return output, "stop"
            if len(output) >= max_tokens or len(tokens) >= max_len:
                return output, "length"


class FakeKvStore:
    """One pool's KV "tensor": per slot (token, position, prefix hash); -1 = never written."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        num_slots = num_blocks * block_size
        self.tokens = np.full(num_slots, -1, dtype=np.int64)
        self.positions = np.full(num_slots, -1, dtype=np.int64)
        self.hashes = np.zeros(num_slots, dtype=np.uint64)
        self.num_writes = 0

    def slots(self, block_table: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Slots of positions [start, stop) through a block table."""
        positions = np.arange(start, stop, dtype=np.int64)
        return block_table[positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
