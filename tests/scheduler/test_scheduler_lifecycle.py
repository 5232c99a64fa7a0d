"""Preemption, aborts in every state, ill workers: blocks freed exactly, outputs unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from justapi.scheduler.request import RequestStatus
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire.protocol import PoolInfo, Ready
from tests.support.sim_prompts import V, in_use, prompt, reference


# ---------------------------------------------------------------------- preemption
def test_out_of_blocks_preempts_the_newest_and_keeps_its_tokens():
    h = Harness(build_scheduler(pool_blocks=7, block_size=4))
    h.submit("old", prompt(8), max_tokens=14, ignore_eos=True)
    h.submit("new", prompt(8, base=9), max_tokens=14, ignore_eos=True)
    new = h.scheduler.request("new")
    seen_waiting_with_output = False
    while h.scheduler.has_work():
        h.step()
        if new.status is RequestStatus.WAITING and h.outputs["new"]:
            seen_waiting_with_output = True
            assert not new.block_ids and new.num_tokens == 8 + len(h.outputs["new"])
    assert seen_waiting_with_output
    assert h.scheduler.stats()["num_preemptions"] >= 1
    assert h.outputs["old"] == reference(prompt(8), 14)
    assert h.outputs["new"] == reference(prompt(8, base=9), 14)


def test_the_newest_of_several_is_preempted_first():
    h = Harness(build_scheduler(pool_blocks=11, block_size=4))
    for i, n in enumerate((6, 8, 8)):  # r0 runs out of blocks last: it must pick a victim
        h.submit(f"r{i}", prompt(n, base=3 + i), max_tokens=14, ignore_eos=True)
    reqs = [h.scheduler.request(f"r{i}") for i in range(3)]
    while not any(r.num_preemptions for r in reqs):
        h.step()
    assert [r.num_preemptions for r in reqs] == [0, 0, 1]
    h.run()
    assert reqs[0].num_preemptions == 0


def test_recompute_after_preemption_resends_all_known_tokens():
    h = Harness(build_scheduler(pool_blocks=7, block_size=4, enable_prefix_cache=False))
    h.submit("old", prompt(8), max_tokens=14, ignore_eos=True)
    h.submit("new", prompt(8, base=9), max_tokens=14, ignore_eos=True)
    resent = []
    while h.scheduler.has_work():
        for worker_id, plan in h.schedule():
            resent += [n.token_ids.tolist() for n in plan.new_requests if n.request_id == "new"]
            h.complete(worker_id, plan)
    assert len(resent) >= 2 and len(resent[1]) > 8  # prompt + the output known so far
    assert resent[1] == (prompt(8, base=9) + h.outputs["new"])[:len(resent[1])]


def test_priority_policy_preempts_the_lowest_priority_first():
    h = Harness(build_scheduler(pool_blocks=10, block_size=4, policy="priority"))
    h.submit("low", prompt(8), max_tokens=20, ignore_eos=True, priority=5)
    h.submit("high", prompt(8, base=9), max_tokens=20, ignore_eos=True, priority=0)
    h.submit("mid", prompt(8, base=17), max_tokens=20, ignore_eos=True, priority=1)
    reqs = {rid: h.scheduler.request(rid) for rid in ("low", "high", "mid")}
    while not any(r.num_preemptions for r in reqs.values()):
        h.step()
    assert [rid for rid, r in reqs.items() if r.num_preemptions] == ["low"]
    h.run()
    assert reqs["high"].num_preemptions == 0
    for rid, base in (("low", 2), ("high", 9), ("mid", 17)):
        assert h.outputs[rid] == reference(prompt(8, base=base), 20)


# ---------------------------------------------------------------------- aborts
def test_abort_waiting_request_finishes_at_once():
    h = Harness(build_scheduler(pool_blocks=4, block_size=4, max_seqs=1))
    h.submit("a", prompt(8), max_tokens=3)
    h.submit("b", prompt(8), max_tokens=3)
    h.step()
    deltas = h.scheduler.abort_request("b")
    assert deltas is not None and deltas.finish_reasons == ["abort"] and deltas.step_id == -1
    assert h.scheduler.request("b") is None and h.scheduler.abort_request("b") is None
    h.scheduler.check_invariants()


@pytest.mark.parametrize("chunk_size, held", [(4, 1), (64, 3)])  # mid-prefill, decoding
def test_abort_running_between_steps_frees_blocks_and_tells_the_worker(chunk_size, held):
    h = Harness(build_scheduler(pool_blocks=16, block_size=4, enable_prefix_cache=False,
                                chunk_size=chunk_size))
    h.submit("a", prompt(9), max_tokens=10)
    h.step()
    assert in_use(h) == held
    h.abort("a")
    assert h.finish_reasons == {"a": "abort"} and in_use(h) == 0
    (_, plan), = h.schedule()
    assert plan.finished_request_ids == ["a"] and plan.num_seqs == 0


@pytest.mark.parametrize("chunk_size", [4, 64])  # mid-prefill, and decoding
def test_abort_in_flight_is_deferred_until_the_worker_is_done(chunk_size):
    h = Harness(build_scheduler(pool_blocks=16, block_size=4, chunk_size=chunk_size))
    h.submit("a", prompt(12), max_tokens=10, ignore_eos=True)
    if chunk_size == 64:
        h.step()
    (worker_id, plan), = h.schedule()
    held = in_use(h)
    assert h.scheduler.abort_request("a") is None
    assert h.scheduler.abort_request("a") is None  # twice is fine
    assert in_use(h) == held  # the worker may still be writing these blocks
    deltas = h.complete(worker_id, plan)
    assert deltas.request_ids == ["a"] and deltas.finish_reasons == ["abort"]
    assert deltas.num_new_tokens.tolist() == [0] and in_use(h) == 0
    (_, plan), = h.schedule()
    assert plan.finished_request_ids == ["a"]


def test_abort_preempted_request_and_unknown_ids():
    h = Harness(build_scheduler(pool_blocks=7, block_size=4))
    h.submit("old", prompt(8), max_tokens=14, ignore_eos=True)
    h.submit("new", prompt(8, base=9), max_tokens=14, ignore_eos=True)
    new = h.scheduler.request("new")
    while new.num_preemptions == 0:
        h.step()
    assert new.status is RequestStatus.WAITING
    h.abort("new")
    assert h.finish_reasons["new"] == "abort"
    assert h.scheduler.abort_request("never-submitted") is None
    h.run()
    assert h.outputs["old"] == reference(prompt(8), 14)


# ---------------------------------------------------------------------- worker health
def test_unhealthy_worker_on_shared_pool_hands_requests_to_the_other():
    h = Harness(build_scheduler(pool_blocks=32, num_workers=2, max_prefill=1))
    h.submit("a", prompt(6), max_tokens=8, ignore_eos=True)
    h.submit("b", prompt(6, base=20), max_tokens=8, ignore_eos=True)
    plans = dict(h.schedule())
    assert set(plans) == {0, 1}
    h.complete(1, plans[1])
    deltas = h.scheduler.mark_worker_unhealthy(0)
    assert deltas.request_ids == []
    late = h.scheduler.update(h.workers[0].execute(plans[0]))
    assert late.request_ids == []  # the discarded step's answer is ignored
    h.scheduler.check_invariants()
    h.run()
    assert h.outputs["a"] == reference(prompt(6), 8)
    assert h.outputs["b"] == reference(prompt(6, base=20), 8)
    assert h.scheduler.stats()["worker_0_is_healthy"] == 0.0


def test_unhealthy_pool_moves_waiting_requests_or_fails_them():
    h = Harness(build_scheduler(pool_blocks=32, num_workers=2, shared_pool=False, max_seqs=1))
    for i in range(4):
        h.submit(f"r{i}", prompt(5, base=2 + i), max_tokens=4, ignore_eos=True)
    h.step()
    h.scheduler.mark_worker_unhealthy(0)
    h.scheduler.check_invariants()
    assert h.scheduler.stats()["pool_0_num_requests_waiting"] == 0
    h.scheduler.abort_request("r3")
    h.run()
    for i in range(3):
        assert h.outputs[f"r{i}"] == reference(prompt(5, base=2 + i), 4)
    h.submit("late", prompt(5), max_tokens=4)
    deltas = h.scheduler.mark_worker_unhealthy(1)
    assert deltas.finish_reasons == ["error"] and "no healthy worker" in deltas.errors["late"]
    with pytest.raises(ValueError, match="no healthy worker"):
        h.submit("later", prompt(5))


def test_a_restarted_worker_is_used_again():
    sched = build_scheduler(pool_blocks=32, num_workers=2)
    sched.mark_worker_unhealthy(1)
    info = PoolInfo(0, "shm", "", "cpu", "float32", 2, 32, 4, 1, 8)
    sched.add_worker(Ready(1, 123, "m", V, 1024, info))
    assert sched.stats()["worker_1_is_healthy"] == 1.0
    sched.add_worker(Ready(2, 124, "m", V, 1024, PoolInfo(5, "cuda_ipc", "", "cuda:1", "f", 2,
                                                          16, 4, 1, 8)))
    assert sorted(sched.pool_ids()) == [0, 5]
    with pytest.raises(ValueError, match="reports 16 blocks in pool 0"):
        sched.add_worker(Ready(3, 125, "m", V, 1024, PoolInfo(0, "shm", "", "cpu", "f", 2, 16, 4,
                                                              1, 8)))
    sched.check_invariants()
    h = Harness(sched)
    h.submit("x", prompt(4), max_tokens=2)
    h.run()
    assert len(h.outputs["x"]) >= 1
    np.testing.assert_equal(sched.stats()["kv_blocks_total"], 48)
