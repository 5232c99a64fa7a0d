"""PdScheduler step by step: where each step runs, what a hand-off moves (zero-copy: nothing;
copy: exactly the computed blocks, after which and only after which the decode step runs),
the prefix cache on the prefill side, aborts and errors during a copy, leases, worker loss,
figures, config and messages."""
from __future__ import annotations

import numpy as np
import pytest

from justapi.config.pd import PdConfig
from justapi.config.sections import ConfigError
from justapi.config.serve import build_config
from justapi.scheduler.pd.scheduler import PdScheduler
from justapi.scheduler.request import RequestStatus
from justapi.scheduler.sim.harness import Harness, build_pd_scheduler
from justapi.scheduler.topology import ModelLimits, Topology
from justapi.wire import codec
from justapi.wire.protocol import BlocksCopied, CopyBlocks, PoolInfo, Ready, StepPlan
from tests.support.sim_prompts import V, prompt, reference


def plans(out) -> list[tuple[int, StepPlan]]:
    return [(w, o) for w, o in out if isinstance(o, StepPlan)]


def copies(out) -> list[tuple[int, CopyBlocks]]:
    return [(w, o) for w, o in out if isinstance(o, CopyBlocks)]


def schedule_copies(h: Harness) -> list[tuple[int, CopyBlocks]]:
    """schedule(): run the step plans at once, hand back the copy orders (not yet done)."""
    out = h.schedule()
    for worker, plan in plans(out):
        h.complete(worker, plan)
    return copies(out)


def pool_info(pool_id: int, handle: str = "", num_blocks: int = 64) -> PoolInfo:
    return PoolInfo(pool_id, "shm", handle or f"seg-{pool_id}", "cpu", "float32", 2, num_blocks,
                    4, 1, 8)


# ---------------------------------------------------------------------- zero-copy
def test_zero_copy_hand_off_moves_only_ownership():
    h = Harness(build_pd_scheduler(pool_blocks=32))
    h.submit("a", prompt(10), max_tokens=6, ignore_eos=True)
    [(worker, plan)] = h.schedule()
    assert worker == 0 and plan.sample_flags.tolist() == [True]  # the prompt, on the prefill worker
    h.complete(worker, plan)
    req = h.scheduler.request("a")
    assert req.status is RequestStatus.HANDOFF and len(h.outputs["a"]) == 1  # first token: prefill
    blocks = list(req.block_ids)
    out = h.schedule()
    assert not copies(out)
    by_worker = dict(plans(out))
    assert by_worker[0].num_seqs == 0 and by_worker[0].finished_request_ids == ["a"]  # drop it
    decode = by_worker[1]
    assert decode.request_ids == ["a"] and decode.start_positions.tolist() == [10]
    assert decode.new_requests[0].token_ids.tolist() == prompt(10) + h.outputs["a"]
    assert list(req.block_ids[:len(blocks)]) == blocks  # the same blocks, now the decode side's
    for w, p in out:
        h.complete(w, p)
    h.run()
    assert h.outputs["a"] == reference(prompt(10), 6)
    # prefill + a plan that drops "a"; 5 decodes + a plan that drops it: decodes on worker 1 only
    assert h.workers[0].num_steps == 2 and h.workers[1].num_steps == 6
    stats = h.scheduler.stats()
    assert stats["pd_num_handoffs"] == 1 and stats["pd_handoff_blocks"] == 3
    assert stats["pd_num_copies"] == 0 and stats["pd_handoff_latency_seconds_count"] == 1


def test_prefill_steps_never_carry_decodes():
    h = Harness(build_pd_scheduler(pool_blocks=256, chunk_size=8))
    for i in range(6):
        h.submit(f"r{i}", prompt(20 + i, base=2 + i), max_tokens=9, ignore_eos=True)
    while h.scheduler.has_work():
        for worker, order in h.schedule():
            if worker == 0:
                assert all(n > 1 or s == 0 for n, s in zip(order.num_tokens, order.start_positions))
                assert not any(start >= 20 for start in order.start_positions)  # prompt positions
            else:
                assert order.num_seqs == 0 or set(order.num_tokens.tolist()) == {1}
            h.complete(worker, order)
    for i in range(6):
        assert h.outputs[f"r{i}"] == reference(prompt(20 + i, base=2 + i), 9)


def test_repeated_system_prompt_is_prefilled_once():
    h = Harness(build_pd_scheduler(pool_blocks=128))
    system = prompt(32, base=7)
    h.submit("first", system + [3, 4], max_tokens=4, ignore_eos=True)
    h.run()
    h.submit("second", system + [5, 6], max_tokens=4, ignore_eos=True)
    [(worker, plan)] = plans(h.schedule())
    assert plan.start_positions.tolist() == [32] and plan.num_tokens.tolist() == [2]
    h.complete(worker, plan)
    h.run()
    assert h.cached_tokens["second"] == 32
    assert h.outputs["second"] == reference(system + [5, 6], 4)


# ---------------------------------------------------------------------- copy path
def test_copy_path_copies_the_computed_blocks_and_decodes_after_the_ack():
    sched = build_pd_scheduler(pool_blocks=32, separate_pools=True)
    sched.set_pool_info(pool_info(0))
    h = Harness(sched)
    h.submit("a", prompt(10), max_tokens=5, ignore_eos=True)
    h.step()
    req = sched.request("a")
    src_blocks = list(req.block_ids)
    out = h.schedule()
    [(worker, order)] = copies(out)
    assert worker == 1 and order.src_pool == 0 and order.src == pool_info(0)
    assert order.src_block_ids.tolist() == src_blocks  # pool 0: relative ids == global ids
    assert len(order.dst_block_ids) == 3 and req.is_in_flight
    assert not any(p.num_seqs for _, p in plans(out))  # no decode before the ack
    for w, p in plans(out):
        h.complete(w, p)
    assert not any(p.num_seqs for _, p in plans(h.schedule()))  # still not
    h.complete(worker, order)
    assert req.pool_id == 1 and [b - 32 for b in req.block_ids] == order.dst_block_ids.tolist()
    assert sched.state.pool.num_in_use(0) == 0  # prefill blocks released (and still cached)
    assert sched.state.pool.num_cached(0) == 2
    [(w, decode)] = [(w, p) for w, p in plans(h.schedule()) if p.num_seqs]
    assert w == 1 and decode.block_ids.tolist()[:3] == order.dst_block_ids.tolist()
    h.complete(w, decode)
    h.run()
    assert h.outputs["a"] == reference(prompt(10), 5)
    stats = sched.stats()
    assert stats["pd_num_copies"] == 1 and stats["pd_copied_blocks"] == 3
    assert stats["pd_copied_bytes"] == 3 * 2 * 2 * 4 * 1 * 8 * 4


def test_decode_side_cache_copies_only_what_it_lacks():
    h = Harness(build_pd_scheduler(pool_blocks=64, separate_pools=True))
    system = prompt(16, base=5)
    h.submit("first", system + [9], max_tokens=6, ignore_eos=True)
    h.run()
    copied = h.scheduler.stats()["pd_copied_blocks"]
    h.submit("second", system + [11], max_tokens=6, ignore_eos=True)
    h.run()
    assert h.scheduler.stats()["pd_copied_blocks"] - copied == 1  # 4 blocks cached on both sides
    assert h.outputs["second"] == reference(system + [11], 6)


def test_abort_during_a_copy_waits_for_the_ack():
    h = Harness(build_pd_scheduler(pool_blocks=32, separate_pools=True))
    h.submit("a", prompt(10), max_tokens=5, ignore_eos=True)
    h.step()
    [(worker, order)] = schedule_copies(h)
    h.abort("a")
    assert "a" not in h.finish_reasons and h.scheduler.stats()["kv_blocks_in_use"] > 0
    h.complete(worker, order)
    assert h.finish_reasons["a"] == "abort"
    assert h.scheduler.stats()["kv_blocks_in_use"] == 0


def test_a_failed_copy_fails_its_request_with_the_reason():
    sched = build_pd_scheduler(pool_blocks=32, separate_pools=True)
    h = Harness(sched)
    h.submit("a", prompt(10), max_tokens=5, ignore_eos=True)
    h.step()
    [(worker, order)] = schedule_copies(h)
    h.record(sched.copy_done(BlocksCopied(order.copy_id, worker, error="no such segment")))
    assert h.finish_reasons["a"] == "error" and "no such segment" in h.errors["a"]
    assert sched.stats()["kv_blocks_in_use"] == 0 and sched.stats()["pd_num_copy_errors"] == 1
    with pytest.raises(ValueError, match="worker 0 acknowledged copy"):
        h.submit("b", prompt(9), max_tokens=5, ignore_eos=True)
        h.step()
        [(_, order)] = schedule_copies(h)
        sched.copy_done(BlocksCopied(order.copy_id, 0))


# ---------------------------------------------------------------------- leases
def test_lapsed_lease_requeues_and_the_late_copy_releases_its_blocks():
    sched = build_pd_scheduler(pool_blocks=32, separate_pools=True, lease_s=5.0)
    h = Harness(sched)
    h.tick(100.0)
    h.submit("a", prompt(10), max_tokens=5, ignore_eos=True)
    h.step()
    [(worker, order)] = schedule_copies(h)
    h.tick(104.0)
    assert sched.request("a").status is RequestStatus.HANDOFF
    h.tick(105.0)  # unclaimed for 5 s: back to the queue; the copy's blocks stay held
    req = sched.request("a")
    assert req.status is RequestStatus.WAITING and not req.block_ids
    assert sched.stats()["pd_num_leases_expired"] == 1 and sched.stats()["kv_blocks_in_use"] == 6
    h.complete(worker, order)  # the late ack frees what the orphaned copy held
    assert sched.stats()["kv_blocks_in_use"] == 0
    h.run()
    assert h.outputs["a"] == reference(prompt(10), 5)


def test_unclaimed_zero_copy_hand_off_is_taken_back():
    sched = build_pd_scheduler(pool_blocks=32, lease_s=2.0)
    h = Harness(sched)
    h.submit("a", prompt(10), max_tokens=5, ignore_eos=True)
    h.step()
    sched.state.workers[1].is_draining = True  # nobody claims it
    h.tick(3.0)
    assert sched.request("a").status is RequestStatus.WAITING
    sched.state.workers[1].is_draining = False
    h.run()
    assert h.outputs["a"] == reference(prompt(10), 5)


# ---------------------------------------------------------------------- worker loss
@pytest.mark.parametrize("separate", [False, True])
def test_decode_worker_death_requeues_and_prefill_side_serves_alone(separate):
    h = Harness(build_pd_scheduler(pool_blocks=64, separate_pools=separate))
    for i in range(3):
        h.submit(f"r{i}", prompt(9, base=3 + i), max_tokens=12, ignore_eos=True)
    for _ in range(6):
        h.step()
    assert any(r.worker_id == 1 for r in h.scheduler.state.requests.values())
    h.kill(1)
    assert h.scheduler.problems() == ["decode pool has no healthy worker "
                                      "(prefill workers serve colocated)"]
    h.run()
    for i in range(3):
        assert h.outputs[f"r{i}"] == reference(prompt(9, base=3 + i), 12)
    assert h.scheduler.stats()["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("separate", [False, True])
def test_prefill_worker_death_mid_prefill_loses_nothing(separate):
    h = Harness(build_pd_scheduler(pool_blocks=64, separate_pools=separate, chunk_size=4))
    h.submit("long", prompt(30), max_tokens=6, ignore_eos=True)
    h.step()
    assert h.scheduler.request("long").num_computed_tokens == 4
    h.kill(0)
    assert h.scheduler.request("long").status is RequestStatus.WAITING
    h.run()  # the decode worker prefills it (degraded), then decodes it
    assert h.outputs["long"] == reference(prompt(30), 6)
    assert h.scheduler.stats()["kv_blocks_in_use"] == 0


def test_copy_to_a_dead_decode_worker_is_redone_on_another():
    sched = build_pd_scheduler(pool_blocks=32, num_decode=2, separate_pools=True)
    h = Harness(sched)
    h.submit("a", prompt(10), max_tokens=5, ignore_eos=True)
    h.step()
    [(worker, order)] = schedule_copies(h)
    h.kill(worker)
    out = h.schedule()
    [(other, again)] = copies(out)
    assert other != worker and again.src_block_ids.tolist() == order.src_block_ids.tolist()
    for w, o in out:
        h.complete(w, o)
    h.run()
    assert h.outputs["a"] == reference(prompt(10), 5)
    assert sched.stats()["kv_blocks_in_use"] == 0


def test_restarted_worker_rejoins_and_hand_offs_resume():
    sched = build_pd_scheduler(pool_blocks=32, separate_pools=True)
    h = Harness(sched)
    h.kill(1)
    h.submit("a", prompt(9), max_tokens=4, ignore_eos=True)
    h.run()
    assert sched.stats()["pd_num_handoffs"] == 0  # served colocated on the prefill worker
    sched.add_worker(Ready(1, 2, "m", V, 1024, pool_info(1, "new-segment", num_blocks=32)))
    assert sched.handoff.pool_infos[1].handle == "new-segment" and not sched.problems()
    h.submit("b", prompt(9, base=4), max_tokens=4, ignore_eos=True)
    h.run()
    assert sched.stats()["pd_num_handoffs"] == 1
    assert h.outputs["b"] == reference(prompt(9, base=4), 4)
    with pytest.raises(ValueError, match="not part of the PD layout"):
        sched.add_worker(Ready(7, 2, "m", V, 1024, pool_info(1, num_blocks=32)))


# ---------------------------------------------------------------------- figures, config, wire
def test_stats_name_both_sides_and_the_latency_histogram():
    sched = build_pd_scheduler(pool_blocks=32, separate_pools=True)
    h = Harness(sched)
    h.tick(1.0)
    h.submit("a", prompt(10), max_tokens=5, ignore_eos=True)
    h.submit("b", prompt(10, base=3), max_tokens=5, ignore_eos=True)
    h.step()
    stats = sched.stats()
    assert stats["pd_decode_num_requests_waiting"] == 2 and stats["pd_prefill_kv_usage"] > 0
    out = schedule_copies(h)
    stats = sched.stats()
    assert stats["pd_num_copies_in_flight"] == 2 and stats["pd_decode_kv_usage"] > 0
    assert stats["pd_prefill_num_workers_healthy"] == 1
    h.tick(1.25)
    for w, o in out:
        h.complete(w, o)
    h.step()
    stats = sched.stats()
    assert stats["pd_decode_num_requests_running"] == 2
    assert stats["pd_decode_seq_occupancy"] == 2 / 32
    assert stats["pd_handoff_latency_seconds_bucket:0.25"] == 2
    assert stats["pd_handoff_latency_seconds_bucket:0.1"] == 0
    assert stats["pd_handoff_latency_seconds_bucket:+Inf"] == 2
    assert stats["pd_handoff_latency_seconds_sum"] == pytest.approx(0.5)


def test_pd_scheduler_validates_its_layout():
    limits = ModelLimits(1024, (1,))
    from justapi.config.sections import CacheConfig, SchedulerConfig
    with pytest.raises(ValueError, match="prefill and decode workers only"):
        PdScheduler(SchedulerConfig(), CacheConfig(), Topology.shared_pool(8, 2), limits)
    with pytest.raises(ValueError, match="continuous batching"):
        PdScheduler(SchedulerConfig(scheduled=False), CacheConfig(), Topology.pd(8, 1, 1), limits)
    small_decode = Topology.pd(100, 1, 1, separate_pools=True)
    sched = PdScheduler(SchedulerConfig(), CacheConfig(block_size=4), small_decode, limits)
    assert sched.state.limits.max_context == 400


def test_pd_config():
    config = build_config({"pd": "2:1", "pd-separate-pools": True}, {})
    assert config.server.workers == 3 and config.pd.num_prefill == 2
    assert [config.pd.role_of(i) for i in range(3)] == ["prefill", "prefill", "decode"]
    assert [config.pd.cpu_pool_of(i) for i in range(3)] == [0, 0, 1]
    assert build_config({"pd": "1:1", "workers": 2}, {}).pd.num_decode == 1
    for values, match in (({"pd": "1:1", "workers": 3}, "workers=3 disagrees"),
                          ({"pd": "0:1"}, "1..32 workers per side"),
                          ({"pd": "one"}, "P:D"),
                          ({"pd-separate-pools": True}, "needs pd"),
                          ({"pd": "1:1", "pd-lease-s": 0}, "pd-lease-s"),
                          ({"pd": "1:1", "scheduled": False}, "continuous batching")):
        with pytest.raises(ConfigError, match=match):
            build_config(values, {})
    with pytest.raises(ValueError, match="outside"):
        PdConfig("1:1").role_of(2)


def test_copy_messages_round_trip():
    order = CopyBlocks(copy_id=3, src_pool=0, src_block_ids=np.array([1, 2], np.int32),
                       dst_block_ids=np.array([7, 9], np.int32), src=pool_info(0))
    back = codec.decode(codec.encode(order))
    assert back.src == order.src and back.src_block_ids.tolist() == [1, 2]
    assert back.dst_block_ids.tolist() == [7, 9]
    plain = codec.decode(codec.encode(CopyBlocks(1, 0, np.zeros(0, np.int32),
                                                 np.zeros(0, np.int32))))
    assert plain.src is None
    ack = BlocksCopied(copy_id=3, worker_id=1, num_blocks=2, error="boom")
    assert codec.decode(codec.encode(ack)) == ack
    with pytest.raises(codec.ProtocolError, match="2 source and 1 destination"):
        CopyBlocks(1, 0, np.array([1, 2], np.int32), np.array([3], np.int32))


def test_gpu_prefill_pool_dying_with_its_worker_recomputes_its_hand_offs():
    sched = build_pd_scheduler(pool_blocks=32, separate_pools=True)
    for pool_id in (0, 1):  # GPU layout: each pool lives in its worker's process
        sched.set_pool_info(PoolInfo(pool_id, "cuda_ipc", "h", f"cuda:{pool_id}", "bfloat16",
                                     2, 32, 4, 1, 8))
    h = Harness(sched)
    h.submit("copying", prompt(10), max_tokens=5, ignore_eos=True)
    h.step()
    [(worker, order)] = schedule_copies(h)
    h.submit("waiting", prompt(9, base=3), max_tokens=5, ignore_eos=True)
    h.step()
    assert sched.request("waiting").status is RequestStatus.HANDOFF
    h.kill(0)  # pool 0's memory is gone: neither hand-off can be copied from it any more
    assert sched.request("copying").status is RequestStatus.WAITING
    assert sched.request("waiting").status is RequestStatus.WAITING
    h.complete(worker, order)  # the orphaned copy's ack only releases its blocks
    h.run()  # the decode worker serves alone
    assert h.outputs["copying"] == reference(prompt(10), 5)
    assert h.outputs["waiting"] == reference(prompt(9, base=3), 5)
    assert sched.stats()["kv_blocks_in_use"] == 0
