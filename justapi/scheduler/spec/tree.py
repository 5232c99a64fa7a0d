"""Token trees of draft tokens: the parent-array form that travels in StepPlan/StepResult.

Node i has token tokens[i] and parent parents[i]: -1 for the root (the request's last known
token) or an earlier node (parents precede children, so any prefix of the nodes is a tree).
Siblings have distinct tokens, so a sequence of tokens names at most one path. A chain is
parents [-1, 0, 1, ...].

    root(last known) -+- n0 -+- n2 -- n4        tokens  [a, b, c, d, e]
                      |      +- n3              parents [-1, -1, 0, 0, 2]
                      +- n1
Owns: that representation and walks over it. Does not own: who builds trees (proposers).
"""
from __future__ import annotations

from collections.abc import Sequence


def chain_parents(num_nodes: int) -> list[int]:
    return list(range(-1, num_nodes - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(int(p) == i - 1 for i, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (children of the root have depth 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def max_depth(parents: Sequence[int]) -> int:
    return max(depths(parents), default=0)


def check_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """ValueError unless parents precede children and siblings have distinct tokens."""
    if len(tokens) != len(parents):
        raise ValueError(f"a token tree needs one parent per token: {len(tokens)} tokens, "
                         f"{len(parents)} parents")
    seen: set[tuple[int, int]] = set()
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must precede children")
        if (parent, token) in seen:
            raise ValueError(f"node {i} repeats token {token} under parent {parent}")
        seen.add((parent, token))


def follow(tokens: Sequence[int], parents: Sequence[int], path: Sequence[int]) -> list[int] | None:
    """Nodes of the root path whose tokens are `path`, or None if there is no such path."""
    nodes: list[int] = []
    current = -1
    for token in path:
        nxt = next((i for i in range(len(tokens))
                    if parents[i] == current and tokens[i] == token), None)
        if nxt is None:
            return None
        nodes.append(nxt)
        current = nxt
    return nodes


def keep_depth(tokens: Sequence[int], parents: Sequence[int],
               limit: int) -> tuple[list[int], list[int]]:
    """The subtree of nodes at depth <= limit (re-indexed; order kept)."""
    keep = [i for i, d in enumerate(depths(parents)) if d <= limit]
    index = {old: new for new, old in enumerate(keep)}
    return ([int(tokens[i]) for i in keep],
            [index[parents[i]] if parents[i] >= 0 else -1 for i in keep])
