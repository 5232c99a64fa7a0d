"""Structured outputs through the real scheduler core with the simulator's fake model and
workers: constrained and free requests in one batch, forced tokens as drafts, n-gram drafts,
preemption, PD hand-offs, aborts and compile failures. Every schedule must give plain
constrained greedy decoding's tokens (tests/support/structured.py), and every output that
finishes with "stop" must validate."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from justapi.sampling import StructuredOutput
from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.harness import Harness, build_pd_scheduler, build_scheduler
from tests.support.structured import (
    SIM_VOCAB,
    reference_constrained,
    sim_token_list,
    text_of,
    with_structured,
)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
REGEX = StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")
CHOICE = StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"]))
GBNF = StructuredOutput("gbnf", 'root ::= "id" [0-9]{2} ("ok" | "no")')
CONSTRAINTS = [JSON, REGEX, CHOICE, GBNF]


def _prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 2 for j in range(5 + i % 7)]


def _run(harness: Harness, structured: list[StructuredOutput | None], max_tokens: int = 64,
         **sampling: object) -> None:
    for i, constraint in enumerate(structured):
        harness.submit(f"r{i}", _prompt(i), max_tokens=max_tokens, structured=constraint,
                       **sampling)
    harness.run()


def _check_outputs(harness: Harness, structured: list[StructuredOutput | None],
                   max_tokens: int = 64) -> None:
    tokenizer = sim_token_list().ll_tokenizer()
    reference = ReferenceModel(SIM_VOCAB)
    for i, constraint in enumerate(structured):
        rid = f"r{i}"
        assert rid not in harness.errors, harness.errors[rid]
        if constraint is None:
            want = reference.generate(_prompt(i), max_tokens, frozenset({1}), 1024)
        else:
            want = reference_constrained(_prompt(i), constraint, max_tokens, tokenizer)
        assert (harness.outputs[rid], harness.finish_reasons[rid]) == want, rid


def _mixed(num: int) -> list[StructuredOutput | None]:
    return [CONSTRAINTS[i // 2 % 4] if i % 2 == 0 else None for i in range(num)]


def test_constrained_and_free_requests_share_steps() -> None:
    structured = _mixed(12)
    harness = Harness(with_structured(build_scheduler(pool_blocks=256, max_seqs=16)),
                      vocab_size=SIM_VOCAB)
    _run(harness, structured)
    _check_outputs(harness, structured)
    for i, constraint in enumerate(structured):
        if constraint is JSON and harness.finish_reasons[f"r{i}"] == "stop":
            jsonschema.validate(json.loads(text_of(harness.outputs[f"r{i}"])), SCHEMA)
    stats = harness.scheduler.stats()
    assert stats["structured_requests"] == 6
    assert stats["structured_cache_hits"] == 2  # JSON and REGEX twice each... compiled once
    assert stats["structured_forced_tokens"] > 0


def test_every_constrained_output_is_valid() -> None:
    harness = Harness(with_structured(build_scheduler(pool_blocks=256, max_seqs=8)),
                      vocab_size=SIM_VOCAB)
    _run(harness, [JSON] * 8, max_tokens=96)
    stopped = [rid for rid, reason in harness.finish_reasons.items() if reason == "stop"]
    assert stopped
    for rid in stopped:
        jsonschema.validate(json.loads(text_of(harness.outputs[rid])), SCHEMA)


def test_forced_tokens_change_steps_not_tokens() -> None:
    """Jump-forward: forced tokens are appended without a step of their own; the output is
    plain constrained decoding's (one token a step, no jumps)."""
    structured = [JSON, CHOICE, GBNF, REGEX]
    jumping = Harness(with_structured(build_scheduler(pool_blocks=256)), vocab_size=SIM_VOCAB)
    plain = Harness(with_structured(build_scheduler(pool_blocks=256), max_forced_tokens=0),
                    vocab_size=SIM_VOCAB)
    _run(jumping, structured)
    _run(plain, structured)
    assert jumping.outputs == plain.outputs and jumping.finish_reasons == plain.finish_reasons
    _check_outputs(jumping, structured)
    fast, slow = jumping.scheduler.stats(), plain.scheduler.stats()
    assert fast["num_steps"] < slow["num_steps"]
    assert fast["structured_forced_tokens"] > 10 and slow["structured_forced_tokens"] == 0
    assert fast["num_draft_tokens"] == 0  # forced tokens are no drafts


def test_forced_tokens_get_logprob_zero() -> None:
    harness = Harness(with_structured(build_scheduler(pool_blocks=64)), vocab_size=SIM_VOCAB)
    harness.submit("c", [3, 4, 5], structured=CHOICE, logprobs=2)
    harness.submit("f", [3, 4, 6], logprobs=2)
    forced_seen = False
    while harness.scheduler.has_work():
        for worker_id, plan in harness.schedule():
            deltas = harness.complete(worker_id, plan)
            off = np.concatenate([[0], np.cumsum(deltas.num_new_tokens)])
            for i, rid in enumerate(deltas.request_ids):
                if rid == "c" and deltas.num_new_tokens[i] > 1:  # "a" sampled, "lpha" forced
                    lo, hi = int(off[i]) + 1, int(off[i + 1])
                    assert np.all(deltas.logprobs[lo:hi] == 0.0)
                    assert deltas.top_logprob_ids[lo:hi, 0].tolist() == deltas.token_ids[lo:hi].tolist()
                    assert np.all(deltas.top_logprob_ids[lo:hi, 1] == -1)
                    forced_seen = True
    assert forced_seen and text_of(harness.outputs["c"]) in ("alpha", "beta", "gamma")


@pytest.mark.parametrize("branch", [1, 2])
def test_ngram_drafts_are_cut_to_the_grammar(branch: int) -> None:
    structured = _mixed(8)
    core = build_scheduler(pool_blocks=256, spec="ngram", gamma=4, branch=branch)
    harness = Harness(with_structured(core), vocab_size=SIM_VOCAB)
    _run(harness, structured)
    _check_outputs(harness, structured)


def test_preemption_keeps_the_matcher() -> None:
    structured = _mixed(10)
    core = build_scheduler(pool_blocks=40, max_seqs=10, chunk_size=8)
    harness = Harness(with_structured(core), vocab_size=SIM_VOCAB)
    _run(harness, structured)
    _check_outputs(harness, structured)
    assert harness.scheduler.stats()["num_preemptions"] > 0


def test_pd_hand_off_keeps_the_matcher() -> None:
    structured = _mixed(6)
    core = build_pd_scheduler(pool_blocks=128, separate_pools=True)
    harness = Harness(with_structured(core), vocab_size=SIM_VOCAB)
    _run(harness, structured)
    _check_outputs(harness, structured)


def test_abort_while_compiling_and_compile_failure() -> None:
    harness = Harness(with_structured(build_scheduler()), vocab_size=SIM_VOCAB)
    harness.submit("bad", [5, 6], structured=StructuredOutput("json_schema", '{"not": {}}'))
    harness.submit("gone", [5, 6], structured=REGEX)
    harness.abort("gone")
    harness.submit("free", [5, 6])
    harness.run()
    assert harness.finish_reasons == {"bad": "error", "gone": "abort", "free": "length"}
    assert 'Unimplemented keys: ["not"]' in harness.errors["bad"]
    assert harness.outputs["bad"] == harness.outputs["gone"] == []


def test_structured_request_without_tokenizer_is_refused() -> None:
    harness = Harness(build_scheduler(), vocab_size=SIM_VOCAB)
    with pytest.raises(ValueError, match="structured outputs need the model's tokenizer"):
        harness.submit("r", [5, 6], structured=REGEX)


def test_masks_travel_with_the_plan() -> None:
    harness = Harness(with_structured(build_scheduler(pool_blocks=64)), vocab_size=SIM_VOCAB)
    harness.submit("free", [3, 4, 5])
    harness.submit("json", [3, 4, 5], structured=CHOICE)
    [(_, plan)] = harness.schedule()
    assert plan.request_ids == ["free", "json"]
    assert plan.bitmask_rows.tolist() == [1]
    words = plan.token_bitmask
    assert words.shape == (1, (len(sim_token_list().tokens) + 31) // 32)
    allowed = np.flatnonzero(np.unpackbits(words[0].view(np.uint8), bitorder="little"))
    tokens = sim_token_list().tokens
    assert sorted(tokens[i] for i in allowed) == [b"a", b"b", b"g"]  # alpha|beta|gamma


@pytest.mark.parametrize("budget", [2, 3])
def test_forced_run_longer_than_the_step_budget(budget: int) -> None:
    """Many constrained decodes under a token budget smaller than one request's forced run
    (1 sampled + num_jumped forced tokens): the run is computed over several steps, each
    within the budget, and the output is plain constrained decoding's."""
    structured = [JSON, JSON, CHOICE, None, GBNF]
    core = build_scheduler(pool_blocks=256, max_batched_tokens=budget, chunk_size=budget)
    harness = Harness(with_structured(core), vocab_size=SIM_VOCAB)
    for i, constraint in enumerate(structured):
        harness.submit(f"r{i}", _prompt(i), max_tokens=64, structured=constraint)
    longest_run = 0
    while harness.scheduler.has_work():
        plans = harness.schedule()
        assert plans, "unfinished requests but no plan"
        for worker_id, plan in plans:
            assert int(plan.num_tokens.sum()) <= budget
            deltas = harness.complete(worker_id, plan)
            longest_run = max([longest_run, *deltas.num_new_tokens.tolist()])
    assert longest_run > budget + 1  # a forced run that did not fit one step's budget
    _check_outputs(harness, structured)
