"""n-gram prompt lookup: propose what followed the last few tokens where they occurred before.

The request's own tokens (prompt and output) are searched for earlier occurrences of their
last n tokens, n from `max_n` down to `min_n`; what followed each occurrence is a candidate
continuation. Candidates are ranked longest n first, then most recent, and merged into a
token tree (a trie: one node per distinct token under a parent) within a shape of nodes per
depth and children per node; a chain keeps the best candidate only. Pure token-id logic:
the search runs as bytes.rfind over the int32 token bytes.

    tokens:  ... the cat sat on the mat . the cat [sat]    <- suffix "the cat" (n = 2)
    match:           ^^^^^^^ followed by "sat on the"       -> chain [sat, on, the]
Owns: the search and the trie. Does not own: how many tokens to propose (budget.py).
"""
from __future__ import annotations

from collections.abc import Sequence

from justapi.scheduler.spec.tree import check_tree

TOKEN_BYTES = 4
MAX_MATCHES_PER_N = 8
"""Occurrences looked at per suffix length: bounds one proposal's cost on long histories."""


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def candidates(self, token_bytes: bytes, depth: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations of at most `depth` tokens, best first."""
        num_tokens = len(token_bytes) // TOKEN_BYTES
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            for start in _occurrences(token_bytes, n):
                stop = min(start + n + depth, num_tokens)
                continuation = _ints(token_bytes, start + n, stop)
                key = tuple(continuation)
                if key not in seen and not any(tuple(c[:len(key)]) == key for c in out):
                    seen.add(key)
                    out.append(continuation)
                    if len(out) >= limit:
                        return out
        return out

    def propose(self, token_bytes: bytes, level_sizes: Sequence[int],
                widths: Sequence[int]) -> tuple[list[int], list[int]]:
        """A token tree (tokens, parents) with at most level_sizes[d] nodes at depth d + 1 and
        widths[d] children per node at depth d; ([], []) when nothing matches."""
        depth = len(level_sizes)
        if depth == 0:
            return [], []
        limit = 1 if max(level_sizes) == 1 else sum(level_sizes)
        trie = _Trie(level_sizes, widths)
        for continuation in self.candidates(token_bytes, depth, limit):
            trie.insert(continuation)
            if trie.is_full:
                break
        return trie.tokens, trie.parents


def _occurrences(token_bytes: bytes, n: int) -> list[int]:
    """Token indices of earlier occurrences of the last n tokens (most recent first) that
    have at least one token after them."""
    needle = token_bytes[-n * TOKEN_BYTES:]
    end = len(token_bytes) - TOKEN_BYTES  # the match must end before the last token
    found: list[int] = []
    while len(found) < MAX_MATCHES_PER_N:
        at = token_bytes.rfind(needle, 0, end)
        if at < 0:
            break
        if at % TOKEN_BYTES == 0:
            found.append(at // TOKEN_BYTES)
        end = at + len(needle) - 1  # look further back (also past a misaligned hit)
    return found


def _ints(token_bytes: bytes, start: int, stop: int) -> list[int]:
    chunk = token_bytes[start * TOKEN_BYTES:stop * TOKEN_BYTES]
    return [int.from_bytes(chunk[i:i + TOKEN_BYTES], "little", signed=True)
            for i in range(0, len(chunk), TOKEN_BYTES)]


class _Trie:
    """Continuations merged into parent-array form under the shape's limits."""

    def __init__(self, level_sizes: Sequence[int], widths: Sequence[int]) -> None:
        self.level_sizes = list(level_sizes)
        self.widths = list(widths)
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._children: dict[int, dict[int, int]] = {-1: {}}
        self._per_level = [0] * len(self.level_sizes)

    @property
    def is_full(self) -> bool:
        return all(n >= size for n, size in zip(self._per_level, self.level_sizes))

    def insert(self, continuation: list[int]) -> None:
        node = -1
        for level, token in enumerate(continuation[:len(self.level_sizes)]):
            children = self._children[node]
            if token in children:
                node = children[token]
                continue
            if (self._per_level[level] >= self.level_sizes[level]
                    or len(children) >= self.widths[level]):
                return
            node = self._add(node, token, level)

    def _add(self, parent: int, token: int, level: int) -> int:
        index = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self._children[parent][token] = index
        self._children[index] = {}
        self._per_level[level] += 1
        return index

    def check(self) -> None:
        check_tree(self.tokens, self.parents)
