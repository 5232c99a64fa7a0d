"""Overlap (justapi/scheduler/overlap.py), step by step with fake workers: the next step is
planned while one runs, with a placeholder for the token in flight; the one-step lag never
emits a token past a stop, frees every block (deferred ones included) and survives aborts,
a lost worker and requests that wait for their token; outputs equal one-step-at-a-time's."""
from __future__ import annotations

from justapi.scheduler.request import RequestStatus
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire.protocol import PLACEHOLDER_TOKEN, StepPlan
from tests.support.sim_prompts import in_use, prompt, reference


def overlapped(**options: object) -> Harness:
    return Harness(build_scheduler(overlap=True, **options))


def plans_of(out: list) -> list[tuple[int, StepPlan]]:
    return [(w, p) for w, p in out if isinstance(p, StepPlan)]


def test_the_next_step_is_planned_with_a_placeholder_while_one_runs():
    h = overlapped(pool_blocks=16)
    h.submit("a", prompt(6), max_tokens=5, ignore_eos=True)
    (w0, first), (w1, second) = h.schedule()
    assert (w0, w1) == (0, 0) and first.start_positions.tolist() == [0]  # the prompt
    assert second.start_positions.tolist() == [6]  # its first decode, before the prompt's token
    assert second.token_ids.tolist() == [PLACEHOLDER_TOKEN] and second.new_requests == []
    assert h.schedule() == []  # two steps in flight: no room
    h.complete(0, first)
    [(_, third)] = h.schedule()  # planned while `second` runs
    assert third.start_positions.tolist() == [7] and third.token_ids.tolist() == [PLACEHOLDER_TOKEN]
    h.complete(0, second)
    h.complete(0, third)
    h.run()
    assert h.outputs["a"] == reference(prompt(6), 5) and in_use(h) == 0


def test_length_is_foreseen_no_step_is_wasted():
    for overlap in (False, True):
        h = Harness(build_scheduler(pool_blocks=16, overlap=overlap))
        h.submit("a", prompt(5), max_tokens=4, ignore_eos=True)
        num_plans = 0
        while h.scheduler.has_work():
            num_plans += sum("a" in p.request_ids for _, p in plans_of(h.step()))
        assert num_plans == 4, overlap  # the prompt + 3 decodes: the 4th token ends it
        assert h.outputs["a"] == reference(prompt(5), 4)


def test_a_stop_is_reported_at_once_and_the_step_after_it_is_dropped():
    expected = reference(prompt(7), 12)
    stop = expected[3]  # the 4th token stops it
    h = overlapped(pool_blocks=16)
    h.submit("a", prompt(7), max_tokens=12, stop_token_ids=[stop])
    h.submit("b", prompt(9, base=5), max_tokens=12, ignore_eos=True)
    pending = list(plans_of(h.schedule()))
    while "a" not in h.finish_reasons:
        worker, plan = pending.pop(0)
        h.complete(worker, plan)
        pending += plans_of(h.schedule())
    req = h.scheduler.request("a")
    assert h.outputs["a"] == expected[:4] and h.finish_reasons["a"] == "stop"
    assert req is not None and req.is_finishing and req.is_in_flight  # blocks kept: still read
    assert req.block_ids and req.status is RequestStatus.RUNNING
    assert all("a" not in p.request_ids for _, p in pending[1:])  # never planned again
    worker, plan = pending.pop(0)
    assert "a" in plan.request_ids  # the step that ran past the stop
    h.complete(worker, plan)
    assert h.scheduler.request("a") is None and h.outputs["a"] == expected[:4]  # token dropped
    pending += plans_of(h.schedule())
    assert any("a" in p.finished_request_ids for _, p in pending)  # the worker drops it
    for worker, plan in pending:
        h.complete(worker, plan)
    h.run()
    assert "a" not in h.workers[0].requests
    assert h.outputs["b"] == reference(prompt(9, base=5), 12) and in_use(h) == 0


def test_an_abort_between_two_steps_in_flight_ends_once_and_frees_all():
    h = overlapped(pool_blocks=16)
    h.submit("a", prompt(6), max_tokens=20, ignore_eos=True)
    first, second = h.schedule()
    h.complete(*first)
    [third] = h.schedule()
    h.abort("a")  # in flight in `second` and `third`
    assert "a" not in h.finish_reasons
    h.complete(*second)
    assert h.finish_reasons["a"] == "abort"
    assert in_use(h) > 0  # `third` may still write its blocks
    h.abort("a")  # again: already reported, nothing more
    h.complete(*third)
    h.run()
    assert h.outputs["a"] == reference(prompt(6), 1) and in_use(h) == 0


def test_a_request_that_waits_for_its_token_is_not_planned_ahead():
    h = overlapped(pool_blocks=32)
    h.submit("free", prompt(4), max_tokens=6, ignore_eos=True)
    h.submit("bound", prompt(5, base=7), max_tokens=6, ignore_eos=True)
    h.scheduler.request("bound").waits_for_token = True  # e.g. its grammar needs the token
    first, second = h.schedule()
    assert set(first[1].request_ids) == {"free", "bound"}
    assert second[1].request_ids == ["free"]
    h.complete(*first)
    h.complete(*second)
    h.run()
    assert h.outputs["bound"] == reference(prompt(5, base=7), 6)
    assert h.outputs["free"] == reference(prompt(4), 6)


def test_a_lost_worker_with_two_steps_in_flight_recomputes_elsewhere():
    h = overlapped(pool_blocks=32, num_workers=2)
    for i in range(4):
        h.submit(f"r{i}", prompt(5 + i, base=3 + i), max_tokens=8, ignore_eos=True)
    out = h.schedule()
    by_worker = [p for w, p in out if w == 1]
    assert len(by_worker) == 2  # both of worker 1's steps are in flight
    for worker, plan in out:
        if worker == 0:
            h.complete(worker, plan)
    h.kill(1)  # its two steps are lost
    h.run()
    for i in range(4):
        assert h.outputs[f"r{i}"] == reference(prompt(5 + i, base=3 + i), 8)
    assert in_use(h) == 0


def test_a_duplicate_block_given_up_under_a_step_in_flight_is_released_when_it_lands():
    """Two workers share a pool; the same prompt prefilled on both: the second to land adopts
    the first's cached blocks, but its next step (in flight) still reads its own, so they stay
    held until that step lands."""
    h = overlapped(pool_blocks=32, num_workers=2, block_size=4)
    same = prompt(9)
    h.submit("a", same, max_tokens=4, ignore_eos=True)
    h.submit("b", same, max_tokens=4, ignore_eos=True)
    out = h.schedule()
    step = {w: [p for v, p in out if v == w] for w in (0, 1)}
    assert all(len(s) == 2 and s[0].start_positions.tolist() == [0] for s in step.values())
    h.complete(0, step[0][0])  # a's prompt lands first: its two full blocks are cached
    h.complete(1, step[1][0])  # b's prompt: duplicates of them
    b = h.scheduler.request("b")
    later = h.scheduler.state.workers[1].in_flight[0]
    assert len(later.deferred_blocks) == 2 and all(holder == "b" for _, holder in later.deferred_blocks)
    assert list(b.block_ids[:2]) == list(h.scheduler.request("a").block_ids[:2])
    held = in_use(h)
    h.complete(1, step[1][1])  # the step that read them lands: they go
    assert in_use(h) == held - 2 and not later.deferred_blocks
    h.complete(0, step[0][1])
    h.run()
    assert h.outputs["a"] == h.outputs["b"] == reference(same, 4) and in_use(h) == 0
