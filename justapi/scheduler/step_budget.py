"""Stall-free batching (Sarathi-Serve's): how much prefill a step with decodes may carry, and
in which order prefills go.

A step that decodes streams takes their time (measured: step_cost.py) plus whatever prefill
it carries, and every stream waits for the whole step. So with decodes in a step its prefill
chunks get a time allowance, turned into tokens by the worker's fitted cost:
  - `itl_target_ms` > 0: the step should take that long: allowance = target - decode time;
  - auto (-1): allowance = PREFILL_PER_DECODE x the decode time, so a burst of long prompts
    still gets 5/6 of each step (chunking costs its prefill ~20% at most) and a stream's
    inter-token latency stays near 6 decode steps;
  - either way at least MIN_PREFILL_PER_DECODE x the decode time, so prompts always progress.
Before the worker's cost is fitted, a step with decodes carries one chunk_size of prefill.
A step without decodes keeps max_batched_tokens (nobody is waiting on it for a token).
Prefill order with the budget on: fewest remaining tokens first (a new conversation turn,
mostly served from the prefix cache, goes ahead of long prompts), aged so that a prompt
waiting PREFILL_AGING_STEPS steps ranks first whatever its length; ties: arrival order.
A multi-step decoding plan runs no longer than MULTI_STEP_PLAN_S at the fitted step time.
Owns: these rules and the per-worker fits. Does not own: the chunks (StepBatch, planner.py).
"""
from __future__ import annotations

import dataclasses

from justapi.scheduler.step_cost import StepCost, StepCostFit, StepFeatures

ITL_TARGET_AUTO = -1.0
ITL_TARGET_OFF = 0.0
PREFILL_PER_DECODE = 5.0  # auto: a step's prefill time per second of its decodes
MIN_PREFILL_PER_DECODE = 0.25  # floor with a target that decodes alone exceed
PREFILL_AGING_STEPS = 128


def prefill_allowance_s(itl_target_s: float, decode_s: float) -> float:
    """Seconds of prefill a step whose decodes take decode_s may add (itl_target_s < 0: auto)."""
    if itl_target_s < 0:
        return PREFILL_PER_DECODE * decode_s
    return max(itl_target_s - decode_s, MIN_PREFILL_PER_DECODE * decode_s)


def prefill_rank(remaining_tokens: int, waited_steps: int) -> float:
    """Sort key of a prefill (smaller first): remaining tokens, shrinking linearly to 0 over
    PREFILL_AGING_STEPS steps of waiting."""
    age = min(max(waited_steps, 0), PREFILL_AGING_STEPS)
    return remaining_tokens * (1.0 - age / PREFILL_AGING_STEPS)


MULTI_STEP_PLAN_S = 0.05
"""A multi-step plan's predicted length at most (multi-step decoding, docs/runtime.md): a
prompt that arrives while a plan runs waits for its end, so that wait stays under ~50 ms."""


def multi_step_count(steps: int, step_s: float) -> int:
    """Steps a multi-step plan runs: at most `steps`, and as many as fit MULTI_STEP_PLAN_S at
    step_s each (at least one); step_s <= 0 (not fitted yet): `steps`."""
    if step_s <= 0:
        return steps
    return max(1, min(steps, int(MULTI_STEP_PLAN_S / step_s)))


MAX_STEPS_IN_FLIGHT = 4
"""Dispatched steps remembered per worker until their results report a time (overlap keeps two
in flight); older ones are forgotten."""


class StepBudget:
    """Per-worker step-cost fits, fed by dispatched steps and the times their results report."""

    def __init__(self, itl_target_ms: float) -> None:
        self.is_enabled = itl_target_ms != ITL_TARGET_OFF
        self.itl_target_s = itl_target_ms / 1000.0 if itl_target_ms > 0 else ITL_TARGET_AUTO
        self._fits: dict[int, StepCostFit] = {}
        # worker -> {step_id: features} of its steps in flight (two with overlap), oldest first
        self._in_flight: dict[int, dict[int, StepFeatures]] = {}

    def dispatched(self, worker_id: int, step_id: int, features: StepFeatures) -> None:
        if self.is_enabled:
            steps = self._in_flight.setdefault(worker_id, {})
            steps[step_id] = features
            while len(steps) > MAX_STEPS_IN_FLIGHT:  # results that never came (a lost worker)
                del steps[next(iter(steps))]

    def observe(self, worker_id: int, step_id: int, time_s: float) -> None:
        """A step's result came back after time_s of work on the worker (0: not measured)."""
        features = self._in_flight.get(worker_id, {}).pop(step_id, None)
        if features is None or time_s <= 0:
            return
        self._fits.setdefault(worker_id, StepCostFit()).observe(features, time_s)

    def cost(self, worker_id: int) -> StepCost | None:
        """The worker's fitted step cost; None while too few steps were measured."""
        fit = self._fits.get(worker_id)
        return fit.estimate() if fit is not None and self.is_enabled else None

    def allowance_s(self, cost: StepCost, decodes: StepFeatures) -> float:
        return prefill_allowance_s(self.itl_target_s, cost.step_s(decodes))

    def stats(self) -> dict[str, float]:
        """The fitted coefficients per worker: `worker_<id>_step_<coefficient>`."""
        out: dict[str, float] = {}
        for worker_id in self._fits:
            cost = self.cost(worker_id)
            if cost is not None:
                for name, value in dataclasses.asdict(cost).items():
                    out[f"worker_{worker_id}_step_{name}"] = value
        return out
