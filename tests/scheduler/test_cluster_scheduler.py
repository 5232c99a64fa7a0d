"""Pools on several hosts (launcher = "ray"), step by step with fake workers: the router weighs
a prefix cached on another host at its blocks less the copy's cost; a request routed away from
its prefix gets it copied in (prefix import) instead of recomputing it; failed, abandoned and
aborted imports cost only the recompute; invariants hold after every event (Harness)."""
from __future__ import annotations

import numpy as np
import pytest

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.scheduler.cluster.hosts import HostMap
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.harness import Harness
from justapi.scheduler.topology import ModelLimits, PoolSpec, Topology, WorkerSpec
from justapi.wire.protocol import BlocksCopied, CopyBlocks, PoolInfo, StepPlan

V = 64
REF = ReferenceModel(V)
BLOCK = 4
PREFIX = [2 + (i * 7) % (V - 2) for i in range(32)]  # 8 full blocks


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    return REF.generate(prompt, max_tokens, frozenset(), 10_000)[0]


def info(pool_id: int, host: str) -> PoolInfo:
    return PoolInfo(pool_id, "shm", f"seg-{pool_id}", "cpu", "float32", 2, 64, BLOCK, 1, 8, host)


def build(hosts: dict[int, str], workers: dict[int, int], cost: float = 0.2,
          **options: object) -> Scheduler:
    """Pools on hosts ({pool: host}) and workers ({worker: pool})."""
    topology = Topology(tuple(PoolSpec(p, 64) for p in sorted(hosts)),
                        tuple(WorkerSpec(w, p) for w, p in sorted(workers.items())))
    host_map = HostMap((info(p, h) for p, h in hosts.items()), cross_host_copy_cost=cost)
    config = SchedulerConfig(**options)  # type: ignore[arg-type]
    return Scheduler(config, CacheConfig(block_size=BLOCK), topology, ModelLimits(1024, (1,)),
                     hosts=host_map)


def two_hosts(cost: float = 0.2) -> Harness:
    return Harness(build({0: "10.0.0.1", 1: "10.0.0.2"}, {0: 0, 1: 1}, cost))


def warm(h: Harness) -> None:
    """Cache PREFIX in pool 0 (the lightest pool with the lowest id takes the first request)."""
    h.submit("warm", PREFIX + [3], max_tokens=3, ignore_eos=True)
    h.run()
    assert h.scheduler.state.kv.probe(0, np.asarray(PREFIX + [9], np.int32).tobytes(), "", 33) == 8


def orders(out) -> tuple[list[tuple[int, CopyBlocks]], list[tuple[int, StepPlan]]]:
    return ([(w, o) for w, o in out if isinstance(o, CopyBlocks)],
            [(w, o) for w, o in out if isinstance(o, StepPlan)])


# ---------------------------------------------------------------------- hosts and costs
def test_host_map_costs_and_hosts():
    hosts = HostMap([info(0, "a"), info(1, "a"), info(2, "b")], cross_host_copy_cost=0.3)
    assert hosts.copy_cost(0, 0) == 0.0 and hosts.copy_cost(0, 1) == pytest.approx(0.02)
    assert hosts.copy_cost(2, 0) == pytest.approx(0.3) and hosts.is_cross_host(0, 2)
    assert hosts.hosts == ["a", "b"] and hosts.block_bytes(0) == 2 * 2 * BLOCK * 1 * 8 * 4
    with pytest.raises(ValueError, match="pool 2 is on host 'b'"):
        hosts.add(info(2, "a"))
    with pytest.raises(ValueError, match="copy costs"):
        HostMap(cross_host_copy_cost=-1)


def test_a_local_prefix_wins_over_an_imported_one():
    h = two_hosts()
    warm(h)
    h.submit("b", PREFIX + [5, 6], max_tokens=4, ignore_eos=True)
    req = h.scheduler.request("b")
    assert req.pool_id == 0  # worth 8 blocks there, 8 x (1 - 0.2) on the other host
    h.run()
    assert h.cached_tokens["b"] == 32 and h.outputs["b"] == reference(PREFIX + [5, 6], 4)
    assert h.scheduler.stats()["kv_imports"] == 0


def test_routed_away_from_its_prefix_a_request_imports_it():
    h = two_hosts()
    warm(h)
    h.scheduler.set_draining(0)  # pool 0 admits nothing new: the request goes to host B
    h.submit("c", PREFIX + [5, 6], max_tokens=4, ignore_eos=True)
    assert h.scheduler.request("c") is None  # held back while its prefix is copied
    [(worker, copy)], plans = orders(h.schedule())
    assert worker == 1 and copy.src_pool == 0 and not plans
    assert len(copy.src_block_ids) == 8 and copy.src.host == "10.0.0.1"
    h.complete(worker, copy)
    h.run()
    assert h.cached_tokens["c"] == 32, "the copied prefix was recomputed"
    assert h.outputs["c"] == reference(PREFIX + [5, 6], 4)
    assert h.workers[1].num_copies == 1
    stats = h.scheduler.stats()
    assert stats["kv_imports"] == 1 and stats["kv_import_blocks"] == 8
    assert stats["kv_import_bytes"] == 8 * HostMap([info(0, "a")]).block_bytes(0)
    assert stats["kv_imports_in_flight"] == 0 and stats["num_hosts"] == 2


def test_an_import_copies_only_what_the_destination_lacks():
    h = two_hosts()
    warm(h)
    h.scheduler.set_draining(0)
    h.submit("half", PREFIX[:16] + [9], max_tokens=2, ignore_eos=True)  # 4 blocks -> pool 1
    [(_, first)], _ = orders(h.schedule())
    h.complete(1, first)
    h.run()
    h.submit("rest", PREFIX + [5], max_tokens=2, ignore_eos=True)
    [(_, second)], _ = orders(h.schedule())
    assert len(second.src_block_ids) == 4  # blocks 4..7: 0..3 are cached on host B already
    h.complete(1, second)
    h.run()
    assert h.cached_tokens["rest"] == 32 and h.outputs["rest"] == reference(PREFIX + [5], 2)


def test_a_copy_that_costs_as_much_as_compute_is_never_made():
    h = two_hosts(cost=1.0)
    warm(h)
    h.scheduler.set_draining(0)
    h.submit("c", PREFIX + [5, 6], max_tokens=4, ignore_eos=True)
    copies, plans = orders(h.schedule())
    assert not copies and plans
    for worker, plan in plans:
        h.complete(worker, plan)
    h.run()
    assert h.cached_tokens["c"] == 0 and h.outputs["c"] == reference(PREFIX + [5, 6], 4)


def test_the_cheapest_source_host_wins():
    sched = build({0: "a", 1: "a", 2: "b"}, {0: 0, 1: 1, 2: 2})
    h = Harness(sched)
    warm(h)
    sched.set_draining(0)
    h.submit("c", PREFIX + [5], max_tokens=2, ignore_eos=True)
    [(worker, copy)], _ = orders(h.schedule())
    assert worker == 1 and copy.src_pool == 0  # same host: 0.98 x 8 beats 0.8 x 8 on host b


def test_a_much_busier_prefix_pool_sends_the_request_to_import_elsewhere():
    h = Harness(build({0: "a", 1: "b"}, {0: 0, 1: 1}, route_balance_abs=1, route_balance_rel=1.0))
    warm(h)
    for i in range(2):  # pool 0 gets busy with requests that share its prefix
        h.submit(f"busy{i}", PREFIX + [10 + i], max_tokens=2, ignore_eos=True)
    assert {h.scheduler.request(f"busy{i}").pool_id for i in range(2)} == {0}
    h.submit("c", PREFIX + [5], max_tokens=2, ignore_eos=True)
    assert h.scheduler.request("c") is None  # routed to host b, importing from host a
    h.run()
    assert h.cached_tokens["c"] == 32 and h.outputs["c"] == reference(PREFIX + [5], 2)


# ---------------------------------------------------------------------- imports that fail
def test_a_failed_copy_recomputes():
    h = two_hosts()
    warm(h)
    h.scheduler.set_draining(0)
    h.submit("c", PREFIX + [5, 6], max_tokens=4, ignore_eos=True)
    [(worker, copy)], _ = orders(h.schedule())
    h.record(h.scheduler.copy_done(BlocksCopied(copy.copy_id, worker, 0, "source worker 0 lost")))
    h.scheduler.check_invariants()
    assert h.scheduler.request("c").pool_id == 1
    h.run()
    assert h.cached_tokens["c"] == 0 and h.outputs["c"] == reference(PREFIX + [5, 6], 4)
    stats = h.scheduler.stats()
    assert stats["kv_import_failures"] == 1 and stats["kv_blocks_in_use"] == 0


def test_an_ack_from_another_worker_is_ignored():
    h = two_hosts()
    warm(h)
    h.scheduler.set_draining(0)
    h.submit("c", PREFIX + [5], max_tokens=2, ignore_eos=True)
    [(worker, copy)], _ = orders(h.schedule())
    h.record(h.scheduler.copy_done(BlocksCopied(copy.copy_id, 0, 8)))
    assert h.scheduler.request("c") is None  # still waiting for worker 1's answer
    h.complete(worker, copy)
    h.run()
    assert h.cached_tokens["c"] == 32


def test_losing_the_copying_worker_recomputes_on_a_peer():
    h = Harness(build({0: "a", 1: "b"}, {0: 0, 1: 1, 2: 1}))
    warm(h)
    h.scheduler.set_draining(0)
    h.submit("c", PREFIX + [5, 6], max_tokens=4, ignore_eos=True)
    [(worker, copy)], _ = orders(h.schedule())
    h.kill(worker)
    assert h.scheduler.request("c").pool_id == 1  # back in host b's queue
    h.run()
    assert h.outputs["c"] == reference(PREFIX + [5, 6], 4)
    assert h.scheduler.stats()["kv_imports_in_flight"] == 0


def test_an_order_for_a_worker_lost_before_it_was_sent_is_dropped():
    h = Harness(build({0: "a", 1: "b"}, {0: 0, 1: 1, 2: 1}))
    warm(h)
    h.scheduler.set_draining(0)
    h.submit("c", PREFIX + [5], max_tokens=2, ignore_eos=True)
    copying = min((1, 2), key=lambda w: (len(h.scheduler.state.workers[w].running), w))
    h.kill(copying)
    copies, plans = orders(h.schedule())
    assert not copies
    for worker, plan in plans:
        h.complete(worker, plan)
    h.run()
    assert h.outputs["c"] == reference(PREFIX + [5], 2)


def test_an_abort_during_the_copy_finishes_at_once_and_the_copy_is_still_cached():
    h = two_hosts()
    warm(h)
    h.scheduler.set_draining(0)
    h.submit("c", PREFIX + [5, 6], max_tokens=4, ignore_eos=True)
    [(worker, copy)], _ = orders(h.schedule())
    h.abort("c")
    assert h.finish_reasons["c"] == "abort"
    h.complete(worker, copy)
    state = h.scheduler.state
    assert state.kv.probe(1, np.asarray(PREFIX + [7], np.int32).tobytes(), "", 33) == 8
    assert state.pool.num_in_use(1) == 0 and not h.scheduler.has_work()


def test_no_healthy_pool_left_after_the_copy_fails_the_request():
    h = two_hosts()
    warm(h)
    h.scheduler.set_draining(0)
    h.submit("c", PREFIX + [5], max_tokens=2, ignore_eos=True)
    orders(h.schedule())
    h.kill(0)
    h.kill(1)
    assert h.finish_reasons["c"] == "error" and "no healthy worker" in h.errors["c"]
