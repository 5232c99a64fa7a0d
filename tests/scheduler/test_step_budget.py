"""The stall-free step budget: the cost fit, the allowance and rank rules (pure functions), and
what the planner does with them - prefill within the allowance when a step decodes, the full
token budget when it does not, a short new prompt ahead of a long running one."""
from __future__ import annotations

import random

import numpy as np
import pytest

from justapi.config.sections import ConfigError, SchedulerConfig
from justapi.scheduler.sim.cost_model import StepCostModel
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.scheduler.step_budget import (
    MAX_STEPS_IN_FLIGHT,
    MIN_PREFILL_PER_DECODE,
    PREFILL_AGING_STEPS,
    PREFILL_PER_DECODE,
    StepBudget,
    prefill_allowance_s,
    prefill_rank,
)
from justapi.scheduler.step_cost import StepCost, StepCostFit, StepFeatures, context_reads
from justapi.wire.protocol import StepPlan


# ---------------------------------------------------------------- step_cost.py
@pytest.mark.parametrize("cost", [StepCost(0.01, 1e-3, 1e-4, 0.0), StepCost(0.0, 2e-4, 0.0, 3e-7),
                                  StepCost(0.0, 0.0, 0.0, 1e-6)])
@pytest.mark.parametrize("start", [0, 37, 1500])
def test_tokens_within_is_the_largest_chunk_that_fits(cost, start):
    for allowance_s in (1e-5, 0.003, 0.25, 1.7):
        n = cost.tokens_within(allowance_s, start)
        assert cost.chunk_s(start, n) <= allowance_s * (1 + 1e-9)
        assert cost.chunk_s(start, n + 1) > allowance_s
    assert cost.tokens_within(0.0, start) == 0
    assert cost.tokens_within(-1.0, start) == 0


def test_context_reads_counts_every_attended_position():
    assert context_reads(0, 1) == 1
    assert context_reads(10, 3) == 11 + 12 + 13


def observe_random_steps(fit: StepCostFit, truth: StepCost, rng: random.Random, num: int,
                         noise: float = 0.0) -> None:
    for _ in range(num):
        prefill = rng.choice([0, 0, rng.randint(1, 2048)])
        start = rng.randint(0, 1500)
        features = StepFeatures(prefill, rng.randint(0, 32),
                                context_reads(start, prefill) + rng.randint(0, 20000))
        fit.observe(features, truth.step_s(features) * (1 + rng.uniform(-noise, noise)))


def test_the_fit_recovers_the_coefficients_of_exact_steps():
    truth = StepCost(0.04, 1.2e-3, 2e-3, 4e-7)
    fit = StepCostFit()
    observe_random_steps(fit, truth, random.Random(0), 60)
    got = fit.estimate()
    assert got is not None
    for name in ("fixed_s", "prefill_token_s", "decode_token_s", "read_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.02), name


def test_the_fit_stays_non_negative_and_close_under_noise():
    truth = StepCost(0.02, 5e-4, 0.0, 0.0)
    fit = StepCostFit()
    observe_random_steps(fit, truth, random.Random(1), 200, noise=0.2)
    got = fit.estimate()
    assert got is not None and min(got.fixed_s, got.prefill_token_s, got.decode_token_s,
                                   got.read_s) >= 0
    step = StepFeatures(512, 8, context_reads(0, 512))
    assert got.step_s(step) == pytest.approx(truth.step_s(step), rel=0.15)


def test_no_estimate_before_enough_steps_with_a_prefill():
    fit = StepCostFit()
    for _ in range(10):
        fit.observe(StepFeatures(0, 8, 800), 0.05)
    assert fit.estimate() is None  # decodes only: nothing says what a prompt token costs
    fit.observe(StepFeatures(100, 0, 5050), 0.2)
    assert fit.estimate() is not None
    fit.observe(StepFeatures(100, 0, 5050), 0.0)  # not measured: ignored
    fit.observe(StepFeatures(100, 0, 5050), float("nan"))


def test_thin_data_puts_the_time_on_prefill_tokens():
    """Identical prefill steps cannot tell a fixed cost from a per-token one: the fit errs
    towards the per-token cost (smaller prefill budgets), never towards a free prompt."""
    fit = StepCostFit()
    for _ in range(5):
        fit.observe(StepFeatures(256, 0, context_reads(0, 256)), 0.3)
    got = fit.estimate()
    assert got is not None
    assert got.chunk_s(0, 256) == pytest.approx(0.3, rel=0.05)
    assert got.fixed_s < 0.01


# ---------------------------------------------------------------- step_budget.py
def test_allowance_auto_explicit_and_floor():
    assert prefill_allowance_s(-1.0, 0.05) == pytest.approx(PREFILL_PER_DECODE * 0.05)
    assert prefill_allowance_s(0.2, 0.05) == pytest.approx(0.15)
    assert prefill_allowance_s(0.04, 0.05) == pytest.approx(MIN_PREFILL_PER_DECODE * 0.05)


def test_rank_prefers_fewer_remaining_tokens_and_ages_to_zero():
    assert prefill_rank(40, 0) < prefill_rank(1500, 0)
    assert prefill_rank(1500, PREFILL_AGING_STEPS // 2) == pytest.approx(750)
    assert prefill_rank(1500, PREFILL_AGING_STEPS) == 0 < prefill_rank(1, 0)
    assert prefill_rank(1500, 10 * PREFILL_AGING_STEPS) == 0
    assert prefill_rank(1500, -3) == 1500


def test_budget_learns_only_from_matching_measured_steps():
    budget = StepBudget(itl_target_ms=-1)
    features = StepFeatures(100, 0, context_reads(0, 100))
    for step_id in range(1, 5):
        budget.dispatched(0, step_id, features)
        budget.observe(0, step_id + 100, 0.1)  # another step's answer (a discarded one)
        budget.observe(0, step_id, 0.0)  # already popped, and unmeasured anyway
    assert budget.cost(0) is None
    for step_id in range(5, 9):
        budget.dispatched(0, step_id, features)
        budget.observe(0, step_id, 0.1)
    assert budget.cost(0) is not None and budget.cost(1) is None
    assert set(budget.stats()) == {"worker_0_step_fixed_s", "worker_0_step_prefill_token_s",
                                   "worker_0_step_decode_token_s", "worker_0_step_read_s"}



def test_budget_learns_from_two_steps_in_flight_and_forgets_lost_ones():
    """Overlap dispatches step N + 1 before N's result: both results still teach the fit; steps
    whose results never come are forgotten, not kept."""
    budget = StepBudget(itl_target_ms=-1)
    features = StepFeatures(100, 0, context_reads(0, 100))
    budget.dispatched(0, 1, features)
    for step_id in range(2, 6):
        budget.dispatched(0, step_id, features)
        budget.observe(0, step_id - 1, 0.1)
    assert budget.cost(0) is not None
    for step_id in range(100, 100 + 10 * MAX_STEPS_IN_FLIGHT):
        budget.dispatched(1, step_id, features)  # worker 1 never answers
    assert len(budget._in_flight[1]) == MAX_STEPS_IN_FLIGHT

def test_budget_off_learns_nothing():
    budget = StepBudget(itl_target_ms=0)
    assert not budget.is_enabled
    for step_id in range(8):
        budget.dispatched(0, step_id, StepFeatures(10, 0, 55))
        budget.observe(0, step_id, 0.1)
    assert budget.cost(0) is None


@pytest.mark.parametrize("value", [-2, -0.5, "fast", True])
def test_itl_target_must_be_auto_off_or_positive(value):
    with pytest.raises(ConfigError, match="itl-target-ms"):
        SchedulerConfig(itl_target_ms=value)
    for good in (-1, 0, 0.5, 250):
        SchedulerConfig(itl_target_ms=good)


# ---------------------------------------------------------------- the planner
COST = StepCostModel(a_s=0.05, b_s=0.001, c_s=0.0)  # decode step of 1: 51 ms; 1 ms per token


def learned_harness(**options: object) -> Harness:
    """A harness whose worker reports COST's step times, after a stream ran long enough for
    the scheduler to fit them; "s" then decodes."""
    sched = build_scheduler(pool_blocks=1024, block_size=16, max_context=4096, **options)
    harness = Harness(sched, step_cost=COST)
    harness.submit("warm", [2 + i % 60 for i in range(700)], max_tokens=3)  # chunks at 0, 512
    harness.submit("s", list(range(3, 19)), max_tokens=200)
    for _ in range(12):
        harness.step()
    return harness


def chunk_of(plan: StepPlan, request_id: str) -> int:
    return int(plan.num_tokens[plan.request_ids.index(request_id)])


def one_plan(harness: Harness) -> StepPlan:
    [(worker_id, plan)] = harness.schedule()
    harness.complete(worker_id, plan)
    assert isinstance(plan, StepPlan)
    return plan


def test_a_step_that_decodes_carries_prefill_only_within_the_allowance():
    harness = learned_harness()
    harness.submit("long", [5] * 1500, max_tokens=2)
    plan = one_plan(harness)
    assert chunk_of(plan, "s") == 1
    allowed = PREFILL_PER_DECODE * COST.a_s / COST.b_s  # (5 x 51 ms) / 1 ms, less 5 tokens' cost
    assert 0.9 * allowed <= chunk_of(plan, "long") <= 1.1 * allowed
    chunks = []
    while "long" in harness.outputs and not harness.outputs["long"]:
        plan = one_plan(harness)
        chunks.append(chunk_of(plan, "long"))
        assert COST.step_time_s(plan) <= 6.2 * COST.a_s  # the stream's step stays short
    assert sum(chunks) + 256 > 1500 - 300


def test_an_explicit_target_sets_the_step_time():
    harness = learned_harness(itl_target_ms=150)
    harness.submit("long", [5] * 1500, max_tokens=2)
    plan = one_plan(harness)
    assert COST.step_time_s(plan) == pytest.approx(0.15, rel=0.1)


@pytest.mark.parametrize("itl_target_ms, cap", [(-1, 128), (0, 4 * 128)])  # off: 4 prefill seats
def test_before_the_fit_a_step_that_decodes_carries_one_chunk(itl_target_ms, cap):
    sched = build_scheduler(pool_blocks=1024, block_size=16, max_context=4096, chunk_size=128,
                            itl_target_ms=itl_target_ms)
    harness = Harness(sched, step_cost=COST)
    harness.submit("s", list(range(3, 19)), max_tokens=200)
    one_plan(harness)  # its prompt: one measured step, no estimate yet
    for i, name in enumerate(("long-a", "long-b", "long-c", "long-d")):
        harness.submit(name, [5 + i] * 1500, max_tokens=2)  # distinct: none waits for another's
    plan = one_plan(harness)
    assert chunk_of(plan, "s") == 1
    assert np.sum(plan.num_tokens) - 1 == cap


def test_a_step_without_decodes_takes_the_whole_chunk():
    harness = learned_harness()
    harness.run()
    harness.submit("long", [5] * 1500, max_tokens=2)
    assert chunk_of(one_plan(harness), "long") == 512  # chunk_size: nobody waits on it


def test_with_the_budget_off_a_step_takes_the_whole_chunk():
    harness = learned_harness(itl_target_ms=0)
    harness.submit("long", [5] * 1500, max_tokens=2)
    assert chunk_of(one_plan(harness), "long") == 512


@pytest.mark.parametrize("itl_target_ms, short_first", [(-1, True), (0, False)])
def test_a_short_prompt_goes_ahead_of_long_ones(itl_target_ms, short_first):
    """One prefill seat: "long" prefills, "long-b" waits; "turn" arrives last."""
    harness = learned_harness(itl_target_ms=itl_target_ms, max_prefill=1, chunk_size=128)
    harness.submit("long", [5] * 1500, max_tokens=2)
    harness.submit("long-b", [7] * 1500, max_tokens=2)
    assert "long-b" not in one_plan(harness).request_ids
    harness.submit("turn", [6] * 40, max_tokens=2)
    plan = one_plan(harness)
    assert ("turn" in plan.request_ids) is short_first
    assert ("long" in plan.request_ids) is not short_first
    assert "long-b" not in plan.request_ids and np.sum(plan.num_tokens) > 1
