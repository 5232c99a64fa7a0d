"""Health table: silence past the timeout or a fatal report marks a worker unhealthy, once."""
from __future__ import annotations

from justapi.health import HEARTBEAT_TIMEOUT_S, HealthMonitor
from justapi.protocol import Heartbeat


def test_missed_heartbeats_mark_unhealthy_once():
    monitor = HealthMonitor()
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.add_worker(1, pool_id=0, now_s=0.0)
    monitor.on_heartbeat(Heartbeat(worker_id=1, time_s=0.0), now_s=1.0)
    assert monitor.newly_unhealthy(1.0) == []
    found = monitor.newly_unhealthy(HEARTBEAT_TIMEOUT_S + 0.1)
    assert [w for w, _ in found] == [0]
    assert "no heartbeat" in found[0][1]
    assert monitor.newly_unhealthy(HEARTBEAT_TIMEOUT_S + 0.2) == []
    assert monitor.problems([0]) == [f"worker 0 unhealthy: {found[0][1]}"]
    assert monitor.is_healthy(1) and not monitor.is_healthy(0)


def test_pool_without_healthy_worker_is_a_problem():
    monitor = HealthMonitor()
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.add_worker(1, pool_id=1, now_s=0.0)
    monitor.on_heartbeat(Heartbeat(worker_id=1, time_s=0.0), now_s=5.0)
    monitor.newly_unhealthy(5.0)
    problems = monitor.problems([0, 1])
    assert "pool 0 has no healthy worker" in problems
    assert not any("pool 1" in p for p in problems)


def test_fatal_gpu_condition_is_unhealthy_at_once():
    monitor = HealthMonitor()
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.on_heartbeat(Heartbeat(worker_id=0, time_s=0.1, gpu={"fatal": "double-bit ECC"}),
                         now_s=0.1)
    assert monitor.newly_unhealthy(0.2) == [(0, "double-bit ECC")]
