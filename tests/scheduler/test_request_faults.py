"""One request's failure stays with it (justapi/scheduler/faults.py), through the real core
with fake workers: an exception while one request of a batch is admitted, planned, masked or
while its result is applied fails that request ("error", the stage in its message, counted by
stage); every other request of the batch finishes with the greedy output it has alone, and no
block is held afterwards (the pool's invariants are checked after every call)."""
from __future__ import annotations

import numpy as np
import pytest

from justapi.sampling import SamplingParams
from justapi.scheduler.batch import StepBatch
from justapi.scheduler.kv.manager import KvCacheManager
from justapi.scheduler.planner import StepPlanner
from justapi.scheduler.request import Request
from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire.protocol import SubmitRequest
from tests.scheduler.test_structured_scheduler import CHOICE, JSON, REGEX
from tests.support.sim_prompts import in_use, prompt, reference
from tests.support.structured import SIM_VOCAB, reference_constrained, sim_token_list, with_structured

BAD = "bad"
MAX_TOKENS = 12
FREE = ReferenceModel(SIM_VOCAB)


class Boom(RuntimeError):
    """The injected fault."""


def _raise_for_bad(original, min_output: int = 0):
    """original(self, req, ...) that raises Boom for request BAD once it has min_output tokens."""
    def wrapper(self, req: Request, *args, **kwargs):
        if req.request_id == BAD and req.num_output_tokens >= min_output:
            raise Boom(f"injected into {original.__name__}")
        return original(self, req, *args, **kwargs)
    return wrapper


def _submit_batch(h: Harness, num: int = 6) -> dict[str, list[int]]:
    """num requests (BAD the third), every one in the first step; their greedy outputs."""
    want = {}
    for i in range(num):
        rid = BAD if i == 2 else f"r{i}"
        p = prompt(5 + i, base=2 + 3 * i)
        h.submit(rid, p, max_tokens=MAX_TOKENS, ignore_eos=True)
        want[rid] = reference(p, MAX_TOKENS)
    return want


def _check(h: Harness, want: dict[str, list[int]], stage: str) -> None:
    assert h.finish_reasons.pop(BAD) == "error"
    assert h.errors[BAD].startswith(f"{stage} failed: Boom: injected")
    assert set(h.finish_reasons.values()) == {"length"}
    for rid, tokens in want.items():
        if rid != BAD:
            assert h.outputs[rid] == tokens, rid
    assert len(h.outputs[BAD]) < MAX_TOKENS
    assert in_use(h) == 0
    h.scheduler.check_invariants()
    stats = h.scheduler.stats()
    assert stats[f"request_failures_{stage}"] == 1
    assert sum(v for k, v in stats.items() if k.startswith("request_failures_")) == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_fails_admission(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    monkeypatch.setattr(KvCacheManager, "match_prefix", _raise_for_bad(KvCacheManager.match_prefix))
    h = Harness(build_scheduler(pool_blocks=64, overlap=overlap))
    want = _submit_batch(h)
    h.run()
    _check(h, want, "admit")
    assert h.outputs[BAD] == []


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_fails_while_planned(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """Mid-generation (holding blocks): its decode's planning raises."""
    monkeypatch.setattr(StepPlanner, "_schedule_decode",
                        _raise_for_bad(StepPlanner._schedule_decode, min_output=3))
    h = Harness(build_scheduler(pool_blocks=64, overlap=overlap))
    want = _submit_batch(h)
    h.run()
    _check(h, want, "plan")
    assert h.outputs[BAD] == want[BAD][:len(h.outputs[BAD])] and len(h.outputs[BAD]) >= 3


def test_a_prefill_that_fails_while_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its second prompt chunk's planning raises: the blocks of its first go back."""
    def chunk_len(self: StepBatch, req: Request, is_prefill: bool) -> int:
        if req.request_id == BAD and req.num_computed_tokens > 0:
            raise Boom("injected into chunk_len")
        return original(self, req, is_prefill)
    original = StepBatch.chunk_len
    monkeypatch.setattr(StepBatch, "chunk_len", chunk_len)
    h = Harness(build_scheduler(pool_blocks=64, chunk_size=4))
    want = _submit_batch(h)
    h.run()
    _check(h, want, "plan")
    assert h.outputs[BAD] == []


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_result_fails(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """Caching its newly full blocks raises while its token is applied."""
    monkeypatch.setattr(KvCacheManager, "cache_computed",
                        _raise_for_bad(KvCacheManager.cache_computed, min_output=4))
    h = Harness(build_scheduler(pool_blocks=64, overlap=overlap))
    want = _submit_batch(h)
    h.run()
    _check(h, want, "results")
    assert h.outputs[BAD] == want[BAD][:len(h.outputs[BAD])]


def test_a_chunk_that_does_not_match_its_request_fails_it_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug that plans more tokens than the request has (the forced-token budget bug did):
    the plan is built without that request, which fails; StepPlan never sees the misfit."""
    def add_decode(self: StepBatch, req: Request, num_tokens: int) -> None:
        original(self, req, num_tokens)
        if req.request_id == BAD and req.num_output_tokens >= 2:
            self.num_tokens[-1] += 1  # one token more than it has
    original = StepBatch.add_decode
    monkeypatch.setattr(StepBatch, "add_decode", add_decode)
    h = Harness(build_scheduler(pool_blocks=64))
    want = _submit_batch(h)
    h.run()
    assert h.errors[BAD].startswith("plan failed: ValueError: a chunk of 2 tokens (0 drafts)")
    h.errors[BAD] = "plan failed: Boom: injected"  # the rest as for any planning fault
    _check(h, want, "plan")


def test_a_constrained_request_whose_mask_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its grammar's mask raises (the masks' "cannot happen" error) in a step that also masks
    other constrained requests: those keep their masks and outputs."""
    import justapi.scheduler.structured as structured_module
    original = structured_module.fill_masks
    core = with_structured(build_scheduler(pool_blocks=128, max_seqs=8))

    def fill_masks(executor, items, num_words):
        bad = core.request(BAD)
        if bad is not None and bad.num_output_tokens >= 2 and any(
                item.grammar is bad.grammar for item in items):
            raise ValueError("draft 7 is not valid: injected")
        return original(executor, items, num_words)
    monkeypatch.setattr(structured_module, "fill_masks", fill_masks)
    h = Harness(core, vocab_size=SIM_VOCAB)
    constraints = {"r0": JSON, "r1": None, BAD: REGEX, "r3": CHOICE, "r4": JSON}
    prompts = {rid: [(7 * i + 3 * j) % 90 + 2 for j in range(5 + i)]
               for i, rid in enumerate(constraints)}
    for rid, constraint in constraints.items():
        h.submit(rid, prompts[rid], max_tokens=40, structured=constraint)
    h.run()
    assert h.finish_reasons[BAD] == "error"
    assert h.errors[BAD] == "mask failed: ValueError: draft 7 is not valid: injected"
    tokenizer = sim_token_list().ll_tokenizer()
    for rid, constraint in constraints.items():
        if rid == BAD:
            continue
        if constraint is None:
            assert h.outputs[rid] == FREE.generate(prompts[rid], 40, frozenset({1}), 1024)[0]
        else:
            assert (h.outputs[rid], h.finish_reasons[rid]) == reference_constrained(
                prompts[rid], constraint, 40, tokenizer), rid
    assert in_use(h) == 0 and h.scheduler.stats()["request_failures_mask"] == 1


def test_a_submit_that_fails_inside_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """add_request raising anything but bad input (a ValueError: rejected) after the core
    took part of the request: the process shell hands it to fail_request, which clears it."""
    h = Harness(build_scheduler(pool_blocks=64))
    core = h.scheduler
    want = _submit_batch(h, num=2)

    def enqueue(req: Request) -> None:
        raise Boom("injected into enqueue")
    monkeypatch.setattr(core.state, "enqueue", enqueue)
    with pytest.raises(Boom):
        core.add_request(SubmitRequest(BAD, np.asarray(prompt(6), np.int32), _params()))
    monkeypatch.undo()
    deltas = core.fail_request(BAD, "admit", Boom("injected into enqueue"))
    assert deltas is not None and deltas.finish_reasons == ["error"]
    assert deltas.errors[BAD] == "admit failed: Boom: injected into enqueue"
    assert core.request(BAD) is None
    assert core.fail_request("never-seen", "admit", Boom("x")) is None  # the shell answers
    h.run()
    assert {rid: h.outputs[rid] for rid in ("r0", "r1")} == {r: want[r] for r in ("r0", "r1")}
    assert core.stats()["request_failures_admit"] == 2 and in_use(h) == 0


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0)


def test_planning_that_fails_outside_any_request_fails_that_step_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in the step's own planning (not one request's part): the requests of that
    step fail, the next plan starts clean, and the requests that were waiting finish."""
    from justapi.scheduler.scheduler import Scheduler
    original, calls = Scheduler._num_steps, []

    def num_steps(self, worker, batch, features):
        calls.append(len(batch))
        if len(calls) == 3:
            raise Boom("injected into the step's planning")
        return original(self, worker, batch, features)
    monkeypatch.setattr(Scheduler, "_num_steps", num_steps)
    h = Harness(build_scheduler(pool_blocks=64, max_seqs=3))
    want = {}
    for i in range(6):
        p = prompt(5 + i, base=2 + 3 * i)
        h.submit(f"r{i}", p, max_tokens=MAX_TOKENS, ignore_eos=True)
        want[f"r{i}"] = reference(p, MAX_TOKENS)
    h.run()
    failed = sorted(rid for rid, reason in h.finish_reasons.items() if reason == "error")
    assert failed == ["r0", "r1", "r2"]  # the third step's batch: the first three
    assert all(h.errors[rid] == "plan failed: Boom: injected into the step's planning"
               for rid in failed)
    assert all(h.outputs[rid] == want[rid] for rid in ("r3", "r4", "r5"))
    assert in_use(h) == 0 and h.scheduler.stats()["request_failures_plan"] == 3
