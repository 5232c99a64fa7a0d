"""Tree attention for speculative decoding: which keys a token-tree row sees, and its rotary
position, as a per-sequence override of the causal chunk layout (workers/model/attention.py).

A chunk's rows always occupy consecutive KV slots (slot position = start + row). A token tree
is laid out in node order in those slots, but node i sits at rotary position root + depth(i)
and sees the keys before `base` (the cached context) plus, from `base` on, only its
ancestors and itself:

    slot pos:   ... P-1 | P (root) | P+1 (n0) | P+2 (n1) | P+3 (n2, child of n0)
    n2 sees:    all     | yes      | yes      | no       | yes        rotary position P+2

The same form serves the draft model's level-by-level expansion, where a level's nodes see
earlier levels' ancestors written by earlier forwards (base = the first node's slot).
Owns: these masks and positions. Does not own: the attention kernels or who builds trees.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TreeMask:
    """One sequence's restricted rows: rows [first_row, num_tokens) of its chunk see keys at
    slot positions < base causally and, in [base, base + span), those marked in `allowed`."""

    seq: int  # index of the sequence in the step
    first_row: int  # first restricted row of the chunk
    base: int  # slot position where the restriction starts
    allowed: np.ndarray  # bool [num restricted rows, span]
    rope: np.ndarray  # int64 [num restricted rows]: rotary positions


@dataclass
class TreeLayout:
    """The tree masks of one step, by sequence index (sequences without one are causal)."""

    masks: dict[int, TreeMask] = field(default_factory=dict)

    def add(self, mask: TreeMask) -> None:
        self.masks[mask.seq] = mask

    def __bool__(self) -> bool:
        return bool(self.masks)

    def rotary_positions(self, token_offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
        out = positions.copy()
        for tm in self.masks.values():
            first = int(token_offsets[tm.seq]) + tm.first_row
            out[first:first + len(tm.rope)] = tm.rope
        return out

    def restrict_short(self, mask: np.ndarray, seqs: np.ndarray) -> None:
        """mask [A, Qmax, Tk] of the padded short group whose a-th sequence is seqs[a]."""
        for a, seq in enumerate(seqs.tolist()):
            tm = self.masks.get(seq)
            if tm is not None:
                rows, span = tm.allowed.shape
                mask[a, tm.first_row:tm.first_row + rows, tm.base:tm.base + span] = tm.allowed

    def restrict_long(self, mask: np.ndarray, seq: int) -> None:
        """mask [num_tokens, num_keys] of one long chunk."""
        tm = self.masks.get(seq)
        if tm is not None:
            rows, span = tm.allowed.shape
            mask[tm.first_row:tm.first_row + rows, tm.base:tm.base + span] = tm.allowed


def depths(parents: Sequence[int]) -> np.ndarray:
    """Depth of each node (children of the root: 1)."""
    out = np.zeros(len(parents), dtype=np.int64)
    for i, parent in enumerate(parents):
        out[i] = 1 if parent < 0 else out[parent] + 1
    return out


def ancestors(parents: Sequence[int]) -> np.ndarray:
    """bool [N, N]: node j is an ancestor of node i, or i itself."""
    num = len(parents)
    out = np.zeros((num, num), dtype=np.bool_)
    for i, parent in enumerate(parents):
        if parent >= 0:
            out[i] = out[parent]
        out[i, i] = True
    return out


def is_chain(parents: Sequence[int]) -> bool:
    return all(int(p) == i - 1 for i, p in enumerate(parents))


def verify_mask(seq: int, num_tokens: int, start: int, parents: Sequence[int]) -> TreeMask:
    """A verification chunk: its last 1 + len(parents) rows are the root (the last known
    token) and the draft nodes in order; the root sees itself, each node root + ancestors."""
    num_drafts = len(parents)
    first_row = num_tokens - 1 - num_drafts
    allowed = np.zeros((1 + num_drafts, 1 + num_drafts), dtype=np.bool_)
    allowed[:, 0] = True  # everyone sees the root
    allowed[1:, 1:] = ancestors(parents)
    base = start + first_row
    rope = base + np.concatenate([[0], depths(parents)])
    return TreeMask(seq, first_row, base, allowed, rope.astype(np.int64))


def level_mask(seq: int, parents: Sequence[int], first_node: int, num_nodes: int,
               root_position: int) -> TreeMask:
    """A draft model's forward of nodes [first_node, first_node + num_nodes) of a tree whose
    root (position root_position) and earlier nodes are in the cache: node i's slot position
    is root_position + 1 + i; it sees the context up to the root, its ancestors and itself."""
    end = first_node + num_nodes
    anc = ancestors(parents[:end])
    rope = root_position + depths(parents[:end])[first_node:end]
    return TreeMask(seq, 0, root_position + 1, anc[first_node:end], rope.astype(np.int64))
