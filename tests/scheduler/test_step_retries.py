"""A step the worker fails (StepResult.error: it raised) fails only the request that caused it
(justapi/scheduler/retries.py), through the real core with fake workers: a worker whose steps
raise whenever one request is in them, from its third output token on. That request ends with
the worker's error; the five that shared its steps are retried (re-queued, then admitted one
suspect at a time) and finish with the greedy output each has alone; no block is held; the
pool's invariants hold after every call. A request alone in a failed step fails at once, and
so does every request of a worker that fails every step, one at a time."""
from __future__ import annotations

import numpy as np
import pytest

from justapi.scheduler.sim.fake_worker import FakeWorkerError
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire.protocol import StepPlan, StepResult
from tests.support.sim_prompts import in_use, prompt, reference

BAD = "bad"
MAX_TOKENS = 12
ERROR = "RuntimeError: injected kernel fault"


def _failing_worker(h: Harness, fails) -> list[int]:
    """Worker 0's steps answer ERROR where fails(plan, worker) says so, as workers/process.py
    answers a step that raised midway (what the plan announced is learned, its KV partly
    written); a plan resting on a failed step's tokens (overlap) may raise in the fake worker,
    as in a real one, and gets the same answer. Returns the failed step ids."""
    worker = h.workers[0]
    execute = worker.execute
    failed: list[int] = []

    def run(plan: StepPlan) -> StepResult:
        fail = fails(plan, worker)
        try:
            result = execute(plan)
        except FakeWorkerError:
            if not failed:
                raise
            fail = True
        if not fail:
            return result
        failed.append(plan.step_id)
        return StepResult(plan.step_id, worker.worker_id, [], np.zeros(0, np.int32),
                          np.zeros(0, np.int32), error=ERROR)
    worker.execute = run  # type: ignore[method-assign]
    return failed


def _bad_in_it(plan: StepPlan, worker) -> bool:
    """BAD is in the plan with at least 3 tokens sampled (a fault its own tokens trigger)."""
    if BAD not in plan.request_ids:
        return False
    announced = {r.request_id: r for r in plan.new_requests}
    known = list(announced[BAD].token_ids) if BAD in announced else worker.requests.get(BAD, [])
    return len(known) >= len(_PROMPTS[BAD]) + 3


_PROMPTS = {(BAD if i == 2 else f"r{i}"): prompt(5 + i, base=2 + 3 * i) for i in range(6)}


def _submit(h: Harness) -> dict[str, list[int]]:
    for rid, p in _PROMPTS.items():
        h.submit(rid, p, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {rid: reference(p, MAX_TOKENS) for rid, p in _PROMPTS.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_the_cause_of_failed_steps_fails_alone(overlap: bool) -> None:
    h = Harness(build_scheduler(pool_blocks=64, overlap=overlap))
    want = _submit(h)
    failed = _failing_worker(h, _bad_in_it)
    h.run()
    assert failed, "no step failed: the test proves nothing"
    assert h.finish_reasons.pop(BAD) == "error" and h.errors[BAD] == ERROR
    assert h.outputs[BAD] == want[BAD][:len(h.outputs[BAD])] and len(h.outputs[BAD]) >= 3
    assert set(h.finish_reasons.values()) == {"length"}
    for rid, tokens in want.items():
        if rid != BAD:
            assert h.outputs[rid] == tokens, rid
    assert in_use(h) == 0
    h.scheduler.check_invariants()
    stats = h.scheduler.stats()
    assert stats["num_step_retries"] >= len(_PROMPTS) - 1 and stats["num_errors"] == 1


def test_a_request_alone_in_a_failed_step_fails_at_once() -> None:
    h = Harness(build_scheduler(pool_blocks=64))
    h.submit(BAD, _PROMPTS[BAD], max_tokens=MAX_TOKENS, ignore_eos=True)
    failed = _failing_worker(h, _bad_in_it)
    h.run()
    assert h.finish_reasons == {BAD: "error"} and len(failed) == 1
    assert h.scheduler.stats()["num_step_retries"] == 0 and in_use(h) == 0


def test_a_worker_that_fails_every_step_fails_each_request_once_alone() -> None:
    """Nothing is the one cause: every request is retried once, then fails as a suspect; the
    core never loops."""
    h = Harness(build_scheduler(pool_blocks=64))
    _submit(h)
    failed = _failing_worker(h, lambda plan, worker: True)
    steps = h.run(max_steps=200)
    assert set(h.finish_reasons.values()) == {"error"} and len(h.finish_reasons) == len(_PROMPTS)
    assert all(not tokens for tokens in h.outputs.values())
    assert h.scheduler.stats()["num_step_retries"] == len(_PROMPTS)
    assert len(failed) <= 2 * len(_PROMPTS) and steps <= 2 * len(_PROMPTS) + 2
    assert in_use(h) == 0


def test_a_retry_waiting_for_its_later_step_stays_a_suspect() -> None:
    """Overlap: a step fails while the next one, planned on its tokens, is in flight; that one
    lands fine (its tokens dropped). Both requests are then re-queued as suspects (a request
    that lost its suspicion there would run beside others again, unserialized)."""
    h = Harness(build_scheduler(pool_blocks=64, overlap=True))
    for rid, p in (("a", prompt(5)), ("b", prompt(6, base=3))):
        h.submit(rid, p, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(3):
        h.step()
    (worker_id, failing), (_, later) = h.schedule()
    assert list(failing.request_ids) == list(later.request_ids) == ["a", "b"]
    h.workers[worker_id].execute(failing)  # computed, then answered as failed
    h.record(h.scheduler.update(StepResult(failing.step_id, worker_id, [], np.zeros(0, np.int32),
                                           np.zeros(0, np.int32), error=ERROR)))
    h.complete(worker_id, later)
    queued = [r for queue in h.scheduler.state.queues.values() for r in queue]
    assert sorted((r.request_id, r.is_suspect, r.retry_pending) for r in queued) == \
        [("a", True, False), ("b", True, False)]
    h.run()
    assert set(h.finish_reasons.values()) == {"length"} and in_use(h) == 0
