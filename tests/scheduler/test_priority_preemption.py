"""The priority policy's preemption (justapi/scheduler/priority.py): a waiting request takes
the seat or blocks of running requests of strictly lower priority, with and without overlap,
and every request still finishes with the output it would have had alone."""
from __future__ import annotations

import pytest

from justapi.scheduler.sim.harness import Harness, build_scheduler
from tests.support import sim_prompts


def prompt(n: int, base: int) -> list[int]:
    return sim_prompts.prompt(n, base, stride=3)


def finish_order(h: Harness) -> list[str]:
    order: list[str] = []
    for _ in range(2000):
        if not h.scheduler.has_work():
            return order
        before = set(h.finish_reasons)
        h.step()
        order += sorted(set(h.finish_reasons) - before)
    raise AssertionError("not done")


def alone(rid: str, tokens: list[int], max_tokens: int) -> list[int]:
    h = Harness(build_scheduler())
    h.submit(rid, tokens, max_tokens=max_tokens, ignore_eos=True)
    h.run()
    return h.outputs[rid]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_waiting_high_priority_request_takes_a_low_priority_seat(overlap):
    h = Harness(build_scheduler(max_seqs=2, policy="priority", overlap=overlap))
    prompts = {"batch-0": prompt(6, 10), "batch-1": prompt(6, 20), "batch-2": prompt(6, 30),
               "urgent": prompt(6, 40)}
    for rid in ("batch-0", "batch-1", "batch-2"):
        h.submit(rid, prompts[rid], max_tokens=30, ignore_eos=True, priority=10)
    for _ in range(3):
        h.step()
    h.submit("urgent", prompts["urgent"], max_tokens=4, ignore_eos=True, priority=0)
    order = finish_order(h)
    assert order[0] == "urgent"
    assert h.scheduler.state.counters.num_preemptions >= 1
    for rid, tokens in prompts.items():  # preempted and recomputed: the same output
        assert h.outputs[rid] == alone(rid, tokens, 4 if rid == "urgent" else 30)


def test_fcfs_never_preempts_for_a_later_request():
    h = Harness(build_scheduler(max_seqs=2))
    for rid, base in (("a", 10), ("b", 20)):
        h.submit(rid, prompt(6, base), max_tokens=20, ignore_eos=True, priority=10)
    h.step()
    h.submit("urgent", prompt(6, 40), max_tokens=2, ignore_eos=True, priority=0)
    order = finish_order(h)
    assert order[-1] == "urgent" and h.scheduler.state.counters.num_preemptions == 0


def test_equal_priorities_do_not_displace_each_other():
    h = Harness(build_scheduler(max_seqs=2, policy="priority"))
    for rid, base in (("a", 10), ("b", 20)):
        h.submit(rid, prompt(6, base), max_tokens=20, ignore_eos=True, priority=3)
    h.step()
    h.submit("c", prompt(6, 40), max_tokens=2, ignore_eos=True, priority=3)
    assert finish_order(h)[-1] == "c"
    assert h.scheduler.state.counters.num_preemptions == 0


def test_a_high_priority_request_takes_blocks_from_low_priority_ones():
    # 12 blocks of 4 tokens: two running requests hold 10; the urgent prompt needs 5
    h = Harness(build_scheduler(pool_blocks=12, max_seqs=8, policy="priority",
                                enable_prefix_cache=False))
    h.submit("low-a", prompt(16, 10), max_tokens=4, ignore_eos=True, priority=5)
    h.submit("low-b", prompt(16, 20), max_tokens=4, ignore_eos=True, priority=7)
    h.step()
    h.submit("urgent", prompt(17, 40), max_tokens=2, ignore_eos=True, priority=1)
    h.step()
    state = h.scheduler.state
    assert state.requests["urgent"].status.value == "running"
    assert state.requests["low-b"].status.value == "waiting"  # the lowest priority went
    assert state.requests["low-a"].status.value == "running"
    h.run()
    assert set(h.finish_reasons) == {"low-a", "low-b", "urgent"}
