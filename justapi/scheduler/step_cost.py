"""What a worker's step costs, learned online from the step times workers report.

    time_s = fixed_s + prefill_token_s * prefill_tokens + decode_token_s * decode_tokens
             + read_s * context_reads

where context_reads sums, over every token computed, the positions it attends to (a chunk of
n tokens at start s reads n * s + n * (n + 1) / 2), as sim/cost_model.py models it.
StepCostFit fits the four coefficients by exponentially weighted least squares (recent steps
count most), non-negative; the fixed and decode terms carry a small ridge, so while the data
cannot tell them apart from the prefill term the step's time is put on its prefill tokens
(that errs towards small prefill budgets, never towards long stalls).
Owns: the coefficients and the fit. Does not own: what the budget does with them (step_budget.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FEATURE_SCALES = (1.0, 1e-3, 1e-2, 1e-6)  # fixed, prefill tokens, decode tokens, reads
RIDGE = (1e-4, 0.0, 1e-4, 0.0)  # pulls the fixed and decode terms to 0 while data is thin
RIDGE_FLOOR = 1e-12  # keeps every system solvable
DECAY = 0.98  # weight of the past per observation: ~50 steps remembered
REFIT_EVERY = 8  # observations between re-solving (the coefficients move slowly)
MIN_OBSERVATIONS = 4  # with prefill tokens in at least one: before that, no estimate


def context_reads(start: int, num_tokens: int) -> int:
    """Positions a chunk of num_tokens tokens at `start` attends to, summed over its tokens."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepFeatures:
    """What a step computed, in the terms of the cost formula."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    reads: int = 0


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients (seconds) of one worker's steps."""

    fixed_s: float = 0.0
    prefill_token_s: float = 0.0
    decode_token_s: float = 0.0
    read_s: float = 0.0

    def step_s(self, features: StepFeatures) -> float:
        return (self.fixed_s + self.prefill_token_s * features.prefill_tokens
                + self.decode_token_s * features.decode_tokens + self.read_s * features.reads)

    def chunk_s(self, start: int, num_tokens: int) -> float:
        """The time a prefill chunk adds to a step."""
        return self.prefill_token_s * num_tokens + self.read_s * context_reads(start, num_tokens)

    def tokens_within(self, allowance_s: float, start: int) -> int:
        """The most prefill tokens at `start` whose chunk_s fits allowance_s (solves
        read_s / 2 * n^2 + (prefill_token_s + read_s * (start + 1/2)) * n = allowance_s)."""
        if allowance_s <= 0:
            return 0
        linear = self.prefill_token_s + self.read_s * (start + 0.5)
        if self.read_s <= 0:
            return int(allowance_s / linear) if linear > 0 else 2**31 - 1
        half_c = self.read_s / 2
        root = (-linear + math.sqrt(linear * linear + 4 * half_c * allowance_s)) / (2 * half_c)
        return int(min(root, 2**31 - 1))


class StepCostFit:
    """Exponentially weighted least squares over observed steps; estimate() is None until
    MIN_OBSERVATIONS steps (one with prefill tokens) were seen."""

    def __init__(self) -> None:
        self._gram = np.zeros((4, 4))  # decayed sum of x x^T (scaled features)
        self._moment = np.zeros(4)  # decayed sum of x * time
        self._num_observations = 0
        self._has_prefill = False
        self._since_fit = 0
        self._cost: StepCost | None = None

    def observe(self, features: StepFeatures, time_s: float) -> None:
        if not time_s > 0 or not math.isfinite(time_s):
            return
        x = np.array((1.0, features.prefill_tokens, features.decode_tokens, features.reads))
        x *= FEATURE_SCALES
        self._gram = DECAY * self._gram + np.outer(x, x)
        self._moment = DECAY * self._moment + x * time_s
        self._num_observations += 1
        self._has_prefill = self._has_prefill or features.prefill_tokens > 0
        self._since_fit += 1

    def estimate(self) -> StepCost | None:
        if self._num_observations < MIN_OBSERVATIONS or not self._has_prefill:
            return None
        if self._cost is None or self._since_fit >= REFIT_EVERY:
            self._cost = StepCost(*solve_non_negative(self._gram, self._moment))
            self._since_fit = 0
        return self._cost


def solve_non_negative(gram: np.ndarray, moment: np.ndarray) -> list[float]:
    """Ridge least squares in scaled features, dropping the most negative coefficient until
    none is left (an active set that suffices for four terms); unscaled coefficients."""
    active = [0, 1, 2, 3]
    weights = np.zeros(4)
    while active:
        sub = gram[np.ix_(active, active)]
        ridge = np.diag([RIDGE[i] * max(gram[0, 0], 1.0) + RIDGE_FLOOR for i in active])
        solved = np.linalg.solve(sub + ridge, moment[active])
        if solved.min() >= 0:
            weights[:] = 0
            weights[active] = solved
            break
        del active[int(np.argmin(solved))]
    return [float(w * s) for w, s in zip(weights, FEATURE_SCALES)]
