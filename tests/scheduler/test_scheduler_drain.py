"""Draining a worker: it admits nothing new, its running requests finish, outputs unchanged;
undrain puts it back; a pool whose workers all drain hands its waiting requests on."""
from __future__ import annotations

import pytest

from justapi.scheduler.request import RequestStatus
from justapi.scheduler.sim.harness import Harness, build_scheduler
from tests.support import sim_prompts
from tests.support.sim_prompts import V, reference


def prompt(n: int, base: int = 2) -> list[int]:
    return sim_prompts.prompt(n, base, stride=7)


def test_a_draining_worker_finishes_its_requests_and_admits_nothing():
    h = Harness(build_scheduler(pool_blocks=64, num_workers=2))
    h.submit("a", prompt(6), max_tokens=10, ignore_eos=True)
    h.submit("b", prompt(6, base=20), max_tokens=10, ignore_eos=True)
    h.step()
    on_0 = [r for r in ("a", "b") if h.scheduler.request(r).worker_id == 0]
    assert len(on_0) == 1
    assert h.scheduler.set_draining(0) == 1
    for i in range(4):
        h.submit(f"n{i}", prompt(5, base=30 + i), max_tokens=4, ignore_eos=True)
    while h.scheduler.has_work():
        for worker_id, plan in h.step():
            if worker_id == 0:
                assert not plan.new_requests, "a draining worker admitted a request"
    assert h.outputs["a"] == reference(prompt(6), 10)
    assert h.outputs["b"] == reference(prompt(6, base=20), 10)
    for i in range(4):
        assert h.outputs[f"n{i}"] == reference(prompt(5, base=30 + i), 4)
    stats = h.scheduler.stats()
    assert stats["worker_0_is_draining"] == 1.0 and stats["worker_0_num_requests_running"] == 0


def test_the_only_accepting_worker_takes_more_than_a_fair_share():
    h = Harness(build_scheduler(pool_blocks=128, num_workers=2))
    h.scheduler.set_draining(1)
    for i in range(6):
        h.submit(f"r{i}", prompt(5, base=3 + i), max_tokens=3, ignore_eos=True)
    h.schedule()
    assert h.scheduler.stats()["worker_0_num_requests_running"] == 4  # max_prefill, not 3


def test_undrain_admits_again():
    h = Harness(build_scheduler(pool_blocks=64, num_workers=1))
    h.scheduler.set_draining(0)
    h.submit("r", prompt(5), max_tokens=3, ignore_eos=True)
    assert h.step() == []
    assert h.scheduler.request("r").status is RequestStatus.WAITING
    assert h.scheduler.set_draining(0, False) == 0
    h.run()
    assert h.outputs["r"] == reference(prompt(5), 3)
    assert h.scheduler.stats()["worker_0_is_draining"] == 0.0


def test_draining_a_pool_moves_its_waiting_requests_and_routes_new_ones_elsewhere():
    h = Harness(build_scheduler(pool_blocks=64, num_workers=2, shared_pool=False, max_seqs=1))
    for i in range(3):
        h.submit(f"r{i}", prompt(5, base=2 + i), max_tokens=3, ignore_eos=True)
    assert h.scheduler.stats()["pool_0_num_requests_waiting"] >= 1
    h.scheduler.set_draining(0)
    assert h.scheduler.stats()["pool_0_num_requests_waiting"] == 0
    h.submit("late", prompt(6), max_tokens=3, ignore_eos=True)
    assert h.scheduler.request("late").pool_id == 1
    h.run()
    for i in range(3):
        assert h.outputs[f"r{i}"] == reference(prompt(5, base=2 + i), 3)
    assert h.outputs["late"] == reference(prompt(6), 3)


def test_draining_every_worker_keeps_requests_waiting_not_failed():
    h = Harness(build_scheduler(pool_blocks=64, num_workers=2, shared_pool=False))
    h.scheduler.set_draining(0)
    h.scheduler.set_draining(1)
    h.submit("r", prompt(5), max_tokens=3, ignore_eos=True)
    assert h.step() == [] and h.scheduler.request("r").status is RequestStatus.WAITING
    h.scheduler.set_draining(1, False)
    h.run()
    assert h.finish_reasons["r"] == "length"


def test_unknown_worker_is_named():
    sched = build_scheduler(num_workers=2)
    with pytest.raises(ValueError, match=r"unknown worker 7 \(workers: \[0, 1\]\)"):
        sched.set_draining(7)


def test_flush_one_pool_only():
    h = Harness(build_scheduler(pool_blocks=64, num_workers=2, shared_pool=False))
    h.submit("a", prompt(12), max_tokens=2, ignore_eos=True)
    h.submit("b", prompt(12, base=9), max_tokens=2, ignore_eos=True)
    h.run()
    before = h.scheduler.stats()
    assert before["pool_0_prefix_cache_blocks"] > 0 and before["pool_1_prefix_cache_blocks"] > 0
    freed = h.scheduler.flush_prefix_cache(pool_id=0)
    after = h.scheduler.stats()
    assert freed == before["pool_0_prefix_cache_blocks"]
    assert after["pool_0_prefix_cache_blocks"] == 0
    assert after["pool_1_prefix_cache_blocks"] == before["pool_1_prefix_cache_blocks"]
    with pytest.raises(ValueError, match="unknown pool 9"):
        h.scheduler.flush_prefix_cache(pool_id=9)
