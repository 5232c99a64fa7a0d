"""Admission order (fcfs, priority, lpm and its fallbacks), static batching, routing."""
from __future__ import annotations

from justapi.scheduler.sim.harness import Harness, build_scheduler
from tests.support import sim_prompts


def prompt(n: int, base: int = 2) -> list[int]:
    return sim_prompts.prompt(n, base, stride=3)


def admission_order(h: Harness) -> list[str]:
    order = []
    while h.scheduler.has_work():
        for worker_id, plan in h.schedule():
            order += [n.request_id for n in plan.new_requests]
            h.complete(worker_id, plan)
    return order


def test_fcfs_admits_in_arrival_order():
    h = Harness(build_scheduler(max_seqs=1))
    for rid in ("c", "a", "b"):
        h.submit(rid, prompt(4, base=10 + ord(rid)), max_tokens=2)
    assert admission_order(h) == ["c", "a", "b"]


def test_priority_admits_lower_values_first_then_by_arrival():
    h = Harness(build_scheduler(max_seqs=1, policy="priority"))
    h.submit("blocker", prompt(4), max_tokens=3, ignore_eos=True, priority=-5)  # outranks all
    h.step()
    for rid, priority in (("low", 5), ("high", -1), ("mid-1", 1), ("mid-2", 1)):
        h.submit(rid, prompt(4, base=20 + priority), max_tokens=2, priority=priority)
    assert admission_order(h) == ["high", "mid-1", "mid-2", "low"]


def lpm_setup(**config) -> Harness:
    h = Harness(build_scheduler(max_seqs=1, policy="lpm", block_size=4, **config))
    h.submit("seed", prompt(16), max_tokens=1, ignore_eos=True)
    h.run()
    h.submit("blocker", prompt(4, base=40), max_tokens=4, ignore_eos=True)
    h.step()
    h.submit("cold", prompt(16, base=30), max_tokens=1)
    h.submit("warm", prompt(16) + [7], max_tokens=1)
    return h


def test_lpm_admits_the_longest_cached_prefix_first():
    assert admission_order(lpm_setup()) == ["warm", "cold"]


def test_lpm_falls_back_to_fcfs_on_long_queues():
    assert admission_order(lpm_setup(lpm_max_waiting=1)) == ["cold", "warm"]


def test_lpm_falls_back_to_fcfs_for_requests_that_waited_too_long():
    assert admission_order(lpm_setup(lpm_max_wait_steps=1)) == ["cold", "warm"]


def test_static_batching_never_admits_mid_batch():
    h = Harness(build_scheduler(max_seqs=3, scheduled=False, pool_blocks=64))
    lengths = [1, 9, 4, 2, 6, 3, 8]
    for i, n in enumerate(lengths):
        h.submit(f"r{i}", prompt(5, base=3 + i), max_tokens=n, ignore_eos=True)
    batches, current = [], set()
    while h.scheduler.has_work():
        for worker_id, plan in h.schedule():
            new = {n.request_id for n in plan.new_requests}
            if new:
                assert not (current - set(h.finish_reasons)), "admitted while the batch runs"
                current = new
                batches.append(sorted(new))
            h.complete(worker_id, plan)
    assert batches == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    assert all(len(h.outputs[f"r{i}"]) == n for i, n in enumerate(lengths))
    assert h.scheduler.stats()["num_preemptions"] == 0


def test_continuous_batching_admits_as_soon_as_a_slot_frees():
    h = Harness(build_scheduler(max_seqs=3, pool_blocks=64))
    for i, n in enumerate([1, 9, 4, 2]):
        h.submit(f"r{i}", prompt(5, base=3 + i), max_tokens=n, ignore_eos=True)
    h.step()  # r0..r2 prefilled, r0 done (1 token)
    (_, plan), = h.schedule()
    assert [n.request_id for n in plan.new_requests] == ["r3"]


def test_routing_prefers_the_pool_with_the_cached_prefix_until_it_is_much_busier():
    h = Harness(build_scheduler(num_workers=2, shared_pool=False, pool_blocks=256,
                                route_balance_abs=8, route_balance_rel=1.5))
    shared = prompt(16)
    h.submit("seed", shared, max_tokens=1, ignore_eos=True)  # equal loads: pool 0
    h.run()
    pools = []
    for i in range(12):
        h.submit(f"p{i}", shared + [9, i + 2], max_tokens=1)
        pools.append(h.scheduler.request(f"p{i}").pool_id)
    h.submit("other", prompt(9, base=33), max_tokens=1)
    # p9 sees load 9 vs 0 (> 0 + 8 and > 0 * 1.5): pool 1; p10: 9 vs 1 is not enough.
    assert pools == [0] * 9 + [1, 0, 1]
    assert h.scheduler.request("other").pool_id == 1  # no cached prefix: the lighter pool
    h.run()
    stats = h.scheduler.stats()
    assert stats["prefix_cache_hit_tokens"] >= 16 * 9


def test_shared_pool_spreads_requests_over_workers():
    h = Harness(build_scheduler(num_workers=3, pool_blocks=128, max_prefill=2))
    for i in range(9):
        h.submit(f"r{i}", prompt(6, base=2 + i), max_tokens=6, ignore_eos=True)
    h.step()
    h.step()
    running = [len(w.running) for w in h.scheduler.state.workers.values()]
    assert sorted(running) == [3, 3, 3]
