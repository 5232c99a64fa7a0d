"""Token bitmasks for one step: a row per constrained logits row, in the step's row order.

A sampled sequence i of a plan has 1 + num_drafts[i] logits rows (its last known token, then
each draft; workers/runner.py logit_rows). A constrained sequence's rows get, in order: the
mask after its output so far, then after each draft's path (drafts are grammar-valid: the
core cut them). Row r of the mask is int32 words, bit b of word w allowing token 32 w + b:

    logits rows:  | seq 0 root | seq 1 root d0 d1 | seq 2 root |     (seq 1 free: no rows)
    bitmask_rows: [0, 4]            token_bitmask: [2, ceil(n_vocab / 32)]

Owns: filling those rows. Does not own: the matchers (matcher.py) or applying the mask
(workers/sampler.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance as llg
import llguidance.numpy as lnp
import numpy as np

from justapi.structured.matcher import RequestGrammar

PARALLEL_MIN_ROWS = 64
"""Fewer rows are filled in the caller's thread (a thread hand-off costs more than it saves)."""


@dataclass(frozen=True)
class MaskItem:
    """One constrained sequence: its first mask row and its drafts (parents [] = a chain)."""

    grammar: RequestGrammar
    first_row: int
    drafts: Sequence[int]
    parents: Sequence[int]


def fill_masks(executor: llg.LLExecutor | None, items: Sequence[MaskItem],
               num_words: int) -> np.ndarray:
    """int32 [sum(1 + drafts), num_words]: every item's rows, items in order, first_row
    counting rows of this array. With an executor and at least PARALLEL_MIN_ROWS rows the
    rows are filled on its threads, else here, one after the other."""
    num_rows = sum(1 + len(item.drafts) for item in items)
    out = np.zeros((num_rows, num_words), dtype=np.int32)
    if executor is None or num_rows < PARALLEL_MIN_ROWS:
        for item in items:
            _fill_chain(item, out) if not item.parents else _fill_tree(item, out)
        return out
    plain = [(item.grammar.live, item.first_row) for item in items if not item.drafts]
    if plain:
        lnp.fill_next_token_bitmask_par(executor, plain, out)
    chains = [(item.grammar.live, item.first_row, [int(t) for t in item.drafts])
              for item in items if item.drafts and not item.parents]
    if chains:
        lnp.fill_next_token_bitmask_par_with_draft_tokens(executor, chains, out)
    for item in items:
        if item.parents:
            _fill_tree(item, out)
    return out


def _fill_chain(item: MaskItem, out: np.ndarray) -> None:
    """A chain's rows: fill, consume the next draft, fill, ...; then roll the drafts back."""
    matcher = item.grammar.live
    lnp.fill_next_token_bitmask(matcher, out, item.first_row)
    for j, token in enumerate(item.drafts):
        if not matcher.consume_token(int(token)):  # the core cut invalid drafts: cannot happen
            # (if it does, this request alone fails: justapi/scheduler/faults.py)
            raise ValueError(f"draft {int(token)} is not valid: {matcher.get_error()}")
        lnp.fill_next_token_bitmask(matcher, out, item.first_row + 1 + j)
    if item.drafts:
        matcher.rollback(len(item.drafts))


def _fill_tree(item: MaskItem, out: np.ndarray) -> None:
    """A token tree's rows: consume each node's path, fill its row, roll the path back."""
    matcher = item.grammar.live
    lnp.fill_next_token_bitmask(matcher, out, item.first_row)
    paths: list[list[int]] = []
    for node, (token, parent) in enumerate(zip(item.drafts, item.parents)):
        path = (paths[parent] if parent >= 0 else []) + [int(token)]
        paths.append(path)
        if not matcher.consume_tokens(path):  # the core cut invalid drafts: cannot happen
            raise ValueError(f"draft path {path} is not valid: {matcher.get_error()}")
        lnp.fill_next_token_bitmask(matcher, out, item.first_row + 1 + node)
        matcher.rollback(len(path))
