"""The adaptive rule: how many draft levels each decoding request gets in the next step.

Cost model: a step of T rows costs (c0 + T) units (c0 = spec-fixed-cost-tokens: on a CPU or
a GPU a small batch is bound by reading the weights, so a few more rows cost little; a large
one by arithmetic, so each row costs its share). Gain model: a request whose drafts are
accepted level by level with probability alpha gains alpha^k expected tokens from its k-th
level, which costs level_costs[k-1] rows (the tree's nodes at that depth).

Greedy: start from plain decoding (E = B tokens for B decodes, T = B + other rows) and keep
adding the level with the best gain per row while it raises the expected tokens per unit of
time, i.e. while gain * (c0 + T) > E * cost. So a batch of one with alpha 0.8 takes every
level; a large batch, or a request whose drafts are rarely accepted, takes few or none.
Owns: that rule and the per-request acceptance estimate. Does not own: proposing.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

PRIOR_ALPHA = 0.6
"""Acceptance assumed for a request with no history (before the global estimate has any)."""
REQUEST_DECAY = 0.7
"""Weight of a request's past verifications at each new one (recent behaviour counts most)."""
GLOBAL_DECAY = 0.99
PRIOR_WEIGHT = 2.0
"""How many verifications' worth the global estimate counts in a request's estimate."""
PROBE_INTERVAL_STEPS = 16
"""A request given no drafts this many steps in a row gets one level, to re-measure alpha."""


@dataclass
class Acceptance:
    """Decayed counts of levels accepted / levels tried (a chain of d drafts with a accepted
    tried min(a + 1, d) levels)."""

    successes: float = 0.0
    trials: float = 0.0

    def observe(self, num_accepted: int, depth: int, decay: float) -> None:
        self.successes = self.successes * decay + num_accepted
        self.trials = self.trials * decay + min(num_accepted + 1, depth)

    def alpha(self, prior: float, prior_weight: float) -> float:
        return (self.successes + prior * prior_weight) / (self.trials + prior_weight)


class AcceptanceTracker:
    """A global estimate (the prior of new requests) plus each request's own."""

    def __init__(self) -> None:
        self.total = Acceptance()

    def observe(self, own: Acceptance, num_accepted: int, depth: int) -> None:
        if depth <= 0:
            return
        own.observe(num_accepted, depth, REQUEST_DECAY)
        self.total.observe(num_accepted, depth, GLOBAL_DECAY)

    def alpha(self, own: Acceptance) -> float:
        prior = self.total.alpha(PRIOR_ALPHA, 1.0)
        return min(0.999, own.alpha(prior, PRIOR_WEIGHT))


def draft_levels(alphas: Sequence[float], level_costs: Sequence[int], num_other_rows: int,
                 fixed_cost: float) -> list[int]:
    """Levels (tree depth) per request, by the greedy rule in the module docstring."""
    num_decodes = len(alphas)
    levels = [0] * num_decodes
    if not level_costs:
        return levels
    expected = float(num_decodes)
    rows = float(num_decodes + num_other_rows)
    heap = [(-alpha / level_costs[0], i, alpha) for i, alpha in enumerate(alphas) if alpha > 0]
    heapq.heapify(heap)
    while heap:
        _, i, gain = heapq.heappop(heap)
        cost = level_costs[levels[i]]
        if gain * (fixed_cost + rows) <= expected * cost:
            break  # the best remaining level no longer pays; worse ones pay even less
        levels[i] += 1
        expected += gain
        rows += cost
        if levels[i] < len(level_costs):
            next_gain = gain * alphas[i]
            heapq.heappush(heap, (-next_gain / level_costs[levels[i]], i, next_gain))
    return levels
