"""A request resubmitted after a scheduler restart (SubmitRequest.output_token_ids: the tokens
the frontend already delivered) continues exactly: a fresh core given the delivered tokens of a
run cut short ends with the uninterrupted run's output, free and constrained (the grammar is
replayed over the delivered tokens, forced ones included), with max_tokens counting what was
delivered and the worker told which tokens are prompt and which output (penalties)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from justapi.sampling import SamplingParams, StructuredOutput
from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire.protocol import EXACT_CHUNK_TOKENS, StepPlan, SubmitRequest
from tests.support.structured import (
    SIM_VOCAB,
    reference_constrained,
    sim_token_list,
    with_structured,
)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "tags", "ok"], "additionalProperties": False}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 40


def _prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 2 for j in range(5 + i % 7)]


def _constraint(i: int) -> StructuredOutput | None:
    return JSON if i % 3 == 0 else None


def _reference(i: int) -> tuple[list[int], str]:
    constraint = _constraint(i)
    if constraint is None:
        return ReferenceModel(SIM_VOCAB).generate(_prompt(i), MAX_TOKENS, frozenset({1}), 1024)
    return reference_constrained(_prompt(i), constraint, MAX_TOKENS,
                                 sim_token_list().ll_tokenizer())


def _harness() -> Harness:
    return Harness(with_structured(build_scheduler(pool_blocks=256, max_seqs=16, chunk_size=8)),
                   vocab_size=SIM_VOCAB)


def _submit(harness: Harness, i: int, delivered: list[int]) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=_constraint(i))
    harness.scheduler.add_request(SubmitRequest(
        f"r{i}", np.asarray(_prompt(i), np.int32), params,
        output_token_ids=np.asarray(delivered, np.int32)))
    harness.outputs[f"r{i}"] = list(delivered)


@pytest.mark.parametrize("num_steps", [3, 9, 20])
def test_a_fresh_core_continues_what_the_dead_one_delivered(num_steps: int) -> None:
    first = _harness()
    for i in range(9):
        _submit(first, i, [])
    for _ in range(num_steps):  # the first scheduler dies after these steps
        first.step()
    second = _harness()  # its successor: empty cache, every block free
    open_ids = [i for i in range(9) if f"r{i}" not in first.finish_reasons]
    assert open_ids, "every request finished before the restart: the test proves nothing"
    for i in open_ids:
        _submit(second, i, first.outputs[f"r{i}"])
    second.run()
    for i in range(9):
        rid = f"r{i}"
        run = first if rid in first.finish_reasons else second
        assert rid not in run.errors, run.errors[rid]
        assert (run.outputs[rid], run.finish_reasons[rid]) == _reference(i), rid


def test_the_worker_learns_delivered_tokens_as_output_and_max_tokens_counts_them() -> None:
    harness = _harness()
    delivered = [5, 6, 7]
    harness.scheduler.add_request(SubmitRequest(
        "r", np.asarray([2, 3, 4, 9], np.int32), SamplingParams(max_tokens=5, temperature=0.0),
        output_token_ids=np.asarray(delivered, np.int32)))
    harness.outputs["r"] = list(delivered)
    plans = harness.schedule()
    plan = plans[0][1]
    assert isinstance(plan, StepPlan)
    new = plan.new_requests[0]
    assert new.num_prompt_tokens == 4  # penalties count 5, 6, 7 as generated
    assert new.token_ids.tolist() == [2, 3, 4, 9, 5, 6, 7]
    for worker_id, order in plans:
        harness.complete(worker_id, order)
    harness.run()
    assert len(harness.outputs["r"]) == 5 and harness.finish_reasons["r"] == "length"
    assert harness.cached_tokens.get("r", 0) == 0  # the first run reported its cached prompt


def test_a_grammar_that_refuses_a_delivered_token_fails_that_request_only() -> None:
    harness = _harness()
    bad = sim_token_list().tokens.index(b"x")  # JSON cannot start with "x"
    _submit(harness, 0, [bad])
    _submit(harness, 1, [])
    harness.run()
    assert harness.finish_reasons["r0"] == "error"
    assert "delivered token" in harness.errors["r0"]
    assert (harness.outputs["r1"], harness.finish_reasons["r1"]) == _reference(1)


def test_delivered_tokens_are_checked() -> None:
    core = build_scheduler()
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(ValueError, match="leave nothing of max_tokens 3"):
        core.add_request(SubmitRequest("a", np.asarray([2, 3], np.int32), params,
                                       output_token_ids=np.asarray([4, 5, 6], np.int32)))
    with pytest.raises(ValueError, match="delivered token ids must be int32"):
        core.add_request(SubmitRequest("b", np.asarray([2, 3], np.int32), params,
                                       output_token_ids=np.asarray([-4], np.int32)))
    with pytest.raises(ValueError, match="leaves no room"):
        core.add_request(SubmitRequest("c", np.asarray([2] * 1000, np.int32),
                                       SamplingParams(max_tokens=100),
                                       output_token_ids=np.asarray([4] * 30, np.int32)))


def test_delivered_tokens_are_recomputed_in_decode_sized_chunks_side_by_side() -> None:
    """A resubmission's prompt is one chunk up to the prompt's end, never running on into the
    delivered tokens; those follow in chunks of at most EXACT_CHUNK_TOKENS (the rows a worker
    computes with decode's arithmetic), which take none of max_prefill's places: six requests
    resubmitted at once with max_prefill 2 all replay in the same steps once their prompts are in."""
    harness = Harness(build_scheduler(pool_blocks=512, max_seqs=16, max_prefill=2, chunk_size=64,
                                      max_batched_tokens=1024), vocab_size=SIM_VOCAB)
    prompts = {f"r{i}": [(5 * i + j) % 90 + 2 for j in range(20 + i)] for i in range(6)}
    delivered = {rid: [(3 * j + 1) % 90 + 2 for j in range(40)] for rid in prompts}
    for rid, prompt in prompts.items():
        harness.scheduler.add_request(SubmitRequest(
            rid, np.asarray(prompt, np.int32), SamplingParams(max_tokens=60, temperature=0.0),
            output_token_ids=np.asarray(delivered[rid], np.int32)))
        harness.outputs[rid] = list(delivered[rid])
    chunks: dict[str, list[tuple[int, int]]] = {rid: [] for rid in prompts}
    most_replaying = 0
    while any(not c or c[-1][0] + c[-1][1] < len(prompts[rid]) + 40 for rid, c in chunks.items()):
        plans = harness.step()
        replaying = 0
        for _, plan in plans:
            assert isinstance(plan, StepPlan)
            for rid, start, n in zip(plan.request_ids, plan.start_positions, plan.num_tokens):
                chunks[rid].append((int(start), int(n)))
                replaying += int(start) >= len(prompts[rid]) and int(n) > 1  # not a decode
        most_replaying = max(most_replaying, replaying)
    for rid, steps in chunks.items():
        prompt_len = len(prompts[rid])
        assert steps[0] == (0, prompt_len), (rid, steps)  # the whole prompt, and no further
        replay = [n for start, n in steps[1:] if start < prompt_len + 40]
        assert sum(replay) == 40 and max(replay) <= EXACT_CHUNK_TOKENS, (rid, steps)
    assert most_replaying == len(prompts)  # side by side, past max_prefill's 2
    harness.run()
    assert all(len(harness.outputs[rid]) == 60 for rid in prompts)
