"""Multi-step decoding (--decode-steps): a plan of single-token decodes runs several steps on
the worker without a round trip. Checked with plan-checking fake workers against the reference
model: outputs, finishes inside a plan (stop token, max_tokens), a waiting request keeping
plans short, an abort while a plan runs, and the invariants after every event."""
from __future__ import annotations

import numpy as np
import pytest

from justapi.scheduler.sim.cost_model import StepCostModel
from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.scheduler.step_budget import MULTI_STEP_PLAN_S, multi_step_count
from justapi.wire.protocol import PLACEHOLDER_TOKEN, ProtocolError, StepPlan, StepResult, merge_step_results

V = 64
REF = ReferenceModel(V)
PROMPT = [2 + (i * 7) % 60 for i in range(9)]
OTHER = [3 + (i * 5) % 50 for i in range(6)]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    return REF.generate(prompt, max_tokens, frozenset(), 10_000)[0]


def harness(steps: int, pool_blocks: int = 64, **options: object) -> Harness:
    return Harness(build_scheduler(pool_blocks=pool_blocks, decode_steps=steps, **options))


def test_a_stream_decodes_in_plans_of_several_steps():
    h = harness(4)
    h.submit("a", PROMPT, max_tokens=10, ignore_eos=True)
    plans = []
    while h.scheduler.has_work():
        plans += [plan.num_steps for _, plan in h.step() if plan.num_seqs]
    assert h.outputs["a"] == reference(PROMPT, 10) and h.finish_reasons["a"] == "length"
    assert plans == [1, 4, 4, 1]  # the prompt, 4 + 4 tokens, and the last one (max_tokens)
    assert h.workers[0].num_steps == 10 + 1  # (+ the plan that only has it forget "a")
    assert h.scheduler.stats()["num_multi_step_plans"] == 2


def test_a_stop_token_inside_a_plan_ends_the_output_there():
    want = reference(PROMPT, 12)
    stop = want[5]
    end = want.index(stop) + 1
    h = harness(4)
    h.submit("a", PROMPT, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    h.run()
    assert h.outputs["a"] == want[:end] and h.finish_reasons["a"] == "stop"
    stats = h.scheduler.stats()
    assert stats["num_multi_step_plans"] >= 1 and stats["kv_blocks_in_use"] == 0


def test_a_waiting_request_keeps_plans_to_one_step_until_it_is_admitted():
    h = harness(4, max_seqs=1)
    h.submit("a", PROMPT, max_tokens=12, ignore_eos=True)
    h.step()  # a's prompt
    h.submit("b", OTHER, max_tokens=6, ignore_eos=True)  # waits: max_seqs = 1
    while "a" not in h.finish_reasons:
        assert all(plan.num_steps == 1 for _, plan in h.step())
    h.run()
    assert h.outputs == {"a": reference(PROMPT, 12), "b": reference(OTHER, 6)}
    assert h.scheduler.stats()["num_multi_step_plans"] >= 1  # b's decodes, nobody waiting


def test_an_abort_while_a_plan_runs_keeps_a_prefix_and_frees_every_block():
    h = harness(5)
    h.submit("a", PROMPT, max_tokens=20, ignore_eos=True)
    h.step()
    [(worker_id, plan)] = h.schedule()
    assert plan.num_steps == 5
    h.abort("a")
    h.complete(worker_id, plan)
    assert h.finish_reasons["a"] == "abort"
    assert h.outputs["a"] == reference(PROMPT, 20)[:len(h.outputs["a"])]
    h.run()  # (the worker is told to forget it)
    assert h.scheduler.stats()["kv_blocks_in_use"] == 0 and not h.workers[0].requests


def test_several_streams_and_preemption_give_the_reference_outputs():
    h = harness(3, pool_blocks=14, chunk_size=8)
    prompts = {f"r{i}": [2 + (i * 13 + j * 3) % 60 for j in range(5 + i)] for i in range(4)}
    for rid, prompt in prompts.items():
        h.submit(rid, prompt, max_tokens=9 + int(rid[1:]), ignore_eos=True)
    h.run()
    assert h.outputs == {rid: reference(p, 9 + int(rid[1:])) for rid, p in prompts.items()}
    assert h.scheduler.stats()["num_multi_step_plans"] >= 1


def test_off_by_default_and_with_speculation():
    h = Harness(build_scheduler(pool_blocks=64))
    h.submit("a", PROMPT, max_tokens=8, ignore_eos=True)
    h.run()
    assert h.scheduler.stats()["num_multi_step_plans"] == 0
    h = Harness(build_scheduler(pool_blocks=64, decode_steps=4, spec="ngram"))
    h.submit("a", PROMPT * 2, max_tokens=8, ignore_eos=True)
    h.run()
    assert h.outputs["a"] == reference(PROMPT * 2, 8)
    assert h.scheduler.stats()["num_multi_step_plans"] == 0


def test_a_plan_splits_into_steps_and_their_results_merge_per_request():
    plan = StepPlan.build(7, [("a", 5, [11], [0, 1], True), ("b", 2, [12], [2], True)])
    plan = StepPlan(**{**plan.__dict__, "num_blocks": np.array([2, 1], np.int32),
                       "num_steps": 3})
    steps = plan.sub_steps()
    assert [s.num_steps for s in steps] == [1, 1, 1]
    assert [s.start_positions.tolist() for s in steps] == [[5, 2], [6, 3], [7, 4]]
    assert steps[0].token_ids.tolist() == [11, 12]
    assert steps[2].token_ids.tolist() == [PLACEHOLDER_TOKEN] * 2
    results = [StepResult(7, 0, ["a", "b"], np.ones(2, np.int32), np.array([t, t + 10], np.int32),
                          logprobs=np.array([-t, -t - 10], np.float32)) for t in (1, 2, 3)]
    merged = merge_step_results(results)
    assert merged.num_sampled.tolist() == [3, 3]
    assert merged.sampled_token_ids.tolist() == [1, 2, 3, 11, 12, 13]
    assert merged.logprobs.tolist() == [-1, -2, -3, -11, -12, -13]


@pytest.mark.parametrize("fields, message", [
    (dict(num_steps=0), "num_steps must be in [1, 64]"),
    (dict(num_steps=65), "num_steps must be in [1, 64]"),
    (dict(num_steps=2, num_tokens=np.array([2], np.int32), token_ids=np.array([1, 2], np.int32)),
     "one sampled token per sequence"),
    (dict(num_steps=2, sample_flags=np.array([False])), "one sampled token per sequence"),
])
def test_malformed_multi_step_plans_are_refused(fields, message):
    base = StepPlan.build(1, [("a", 3, [5], [0], True)]).__dict__
    with pytest.raises(ProtocolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        StepPlan(**{**base, **fields})


@pytest.mark.parametrize("steps, step_s, want", [
    (4, 0.0, 4),  # not fitted yet: as configured
    (4, 0.009, 4),  # 5 would fit 50 ms; the configured 4 caps it
    (4, 0.02, 2),
    (4, 0.03, 1),
    (4, 0.2, 1),  # one step whatever its length
    (1, 0.001, 1),
])
def test_a_plan_runs_as_many_steps_as_fit_its_time_cap(steps, step_s, want):
    assert MULTI_STEP_PLAN_S == 0.05
    assert multi_step_count(steps, step_s) == want


@pytest.mark.parametrize("fixed_s, want", [(0.004, 4), (0.02, 2), (0.03, 1)])
def test_once_the_step_cost_is_fitted_plans_stay_within_the_cap(fixed_s, want):
    """A worker whose steps take fixed_s (+ a little per token) gets plans of as many steps
    as fit 50 ms once its cost is fitted; the outputs do not change."""
    h = Harness(build_scheduler(pool_blocks=64, decode_steps=4),
                step_cost=StepCostModel(a_s=fixed_s, b_s=1e-5, c_s=0.0))
    h.submit("a", PROMPT, max_tokens=60, ignore_eos=True)
    plans = []
    while h.scheduler.has_work():
        plans += [plan.num_steps for _, plan in h.step() if plan.num_seqs]
    assert h.outputs["a"] == reference(PROMPT, 60)
    assert plans[0] == 1 and plans[1] == 4  # the prompt; decodes before the fit
    assert plans[-4:-1] == [want] * 3  # fitted (the last plan is what max_tokens leaves)
