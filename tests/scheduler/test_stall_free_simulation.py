"""Stall-free batching in the simulation (modelled step times, which the fake workers report as
real workers report theirs): under a burst of long prompts the decoding streams keep their
pace with the budget on, the burst's TTFT stays within 20%, a short new turn goes ahead, a
long prompt never starves behind short ones, and outputs equal the reference with any budget."""
from __future__ import annotations

import functools
import math
import random

import pytest

from justapi.scheduler.sim.cost_model import StepCostModel
from justapi.scheduler.sim.records import SimResult
from justapi.scheduler.sim.simulation import Simulation
from justapi.scheduler.sim.trace import TraceRequest
from justapi.scheduler.step_budget import PREFILL_PER_DECODE
from tests.scheduler.test_simulation import (
    V,
    build,
    check_no_leak,
    check_result,
    random_config,
    random_trace,
)

COST = StepCostModel(a_s=0.05, b_s=0.001, c_s=2e-7)  # a CPU-like worker: 1 ms per prompt token
BURST_S = 1.0
NUM_STREAMS = 4


def burst_trace() -> list[TraceRequest]:
    """Streams decode from t=0; long prompts arrive together at BURST_S, a short new
    conversation turn just after them."""
    trace = [TraceRequest(0.0, 128, 128, request_id=f"stream-{i}") for i in range(NUM_STREAMS)]
    trace += [TraceRequest(BURST_S, 8, 1200, request_id=f"burst-{i}") for i in range(4)]
    trace.append(TraceRequest(BURST_S + 0.5, 8, 40, request_id="turn"))
    return trace


@functools.lru_cache(maxsize=None)
def run_burst(itl_target_ms: float) -> SimResult:
    sched = build(dict(itl_target_ms=itl_target_ms), 16, 1024, 1, True)
    result = Simulation(sched, vocab_size=V, cost=COST).run(burst_trace())  # (timing only)
    check_result(sched, result)
    check_no_leak(sched)
    return result


def streams_itl_during_burst(result: SimResult) -> list[float]:
    bursts = [r for rid, r in result.records.items() if rid.startswith("burst")]
    end_s = max(r.first_token_s for r in bursts if r.first_token_s is not None)
    return [later - earlier for rid, r in result.records.items() if rid.startswith("stream")
            for earlier, later in zip(r.token_times_s, r.token_times_s[1:])
            if later > BURST_S and earlier < end_s]


def burst_ttfts(result: SimResult) -> list[float]:
    return [r.ttft_s for rid, r in result.records.items()
            if rid.startswith("burst") and r.ttft_s is not None]


def test_streams_keep_their_pace_through_a_burst():
    decode_step_s = COST.a_s + COST.b_s * NUM_STREAMS
    off, auto, explicit = run_burst(0), run_burst(-1), run_burst(200)
    assert max(streams_itl_during_burst(off)) > 1.5  # a step of 2048 prompt tokens
    assert max(streams_itl_during_burst(auto)) <= 1.1 * (1 + PREFILL_PER_DECODE) * decode_step_s
    assert max(streams_itl_during_burst(explicit)) <= 0.21


def test_the_burst_loses_at_most_a_fifth_of_its_ttft():
    """With the auto budget; an explicit target below it trades burst TTFT for ITL."""
    off, on = burst_ttfts(run_burst(0)), burst_ttfts(run_burst(-1))
    assert len(on) == len(off) == 4
    assert sum(on) <= 1.2 * sum(off)
    assert max(on) <= 1.2 * max(off)


def test_a_short_turn_goes_ahead_of_the_long_prompts():
    off, auto = run_burst(0).records["turn"].ttft_s, run_burst(-1).records["turn"].ttft_s
    assert off is not None and auto is not None
    assert auto < 0.5 < off and auto < off / 4


@pytest.mark.parametrize("long_arrival_s", [0.0, 0.05])  # running first, or waiting
def test_a_long_prompt_never_starves_behind_short_ones(long_arrival_s):
    """One prefill seat, short prompts arriving faster than they are served: they go first,
    but aging gets the long one its turn while they are still arriving."""
    trace = [TraceRequest(long_arrival_s, 2, 400, request_id="long")]
    trace += [TraceRequest(0.01 + 0.005 * i, 2, 8, request_id=f"short-{i}") for i in range(500)]
    sched = build(dict(max_prefill=1, chunk_size=64), 8, 1024, 1, True)
    result = Simulation(sched, vocab_size=V, cost=StepCostModel(a_s=0.01, b_s=1e-5, c_s=0.0)
                        ).run(trace)
    check_result(sched, result)
    long = result.records["long"]
    assert long.first_token_s is not None
    assert long.first_token_s < trace[-1].arrival_s  # not after every short one
    assert sum(r.first_token_s < long.first_token_s  # type: ignore[operator]
               for rid, r in result.records.items() if rid != "long") > 20  # shorts went first


@pytest.mark.parametrize("seed", range(16))
def test_any_budget_leaves_outputs_unchanged(seed):
    rng = random.Random(7000 + seed)
    block_size = rng.choice([2, 4, 16])
    max_prompt = rng.choice([24, 64])
    pool_blocks = math.ceil((max_prompt + 24) / block_size) + rng.choice([0, 4, 200])
    num_workers, shared = rng.choice([(1, True), (2, True), (2, False)])
    config = dict(random_config(rng), itl_target_ms=rng.choice([-1, -1, 0.01, 0.3, 5.0]))
    sched = build(config, block_size, pool_blocks, num_workers, shared)
    cost = StepCostModel(a_s=rng.choice([0.001, 0.02]), b_s=rng.choice([1e-5, 1e-3]),
                         c_s=rng.choice([0.0, 1e-6]))
    result = Simulation(sched, vocab_size=V, cost=cost, check_invariants=True).run(
        random_trace(rng, rng.randint(6, 18), max_prompt))
    check_result(sched, result)
    check_no_leak(sched)
