"""Health table: silence past the timeout, a hung step or a fatal report marks a worker
unhealthy, once; a pool without a healthy worker is a problem, one unhealthy worker a warning."""
from __future__ import annotations

from justapi.health.table import HEARTBEAT_TIMEOUT_S, HealthMonitor
from justapi.wire.protocol import Heartbeat


def test_missed_heartbeats_mark_unhealthy_once():
    monitor = HealthMonitor()
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.add_worker(1, pool_id=0, now_s=0.0)
    monitor.on_heartbeat(Heartbeat(worker_id=1, time_s=0.0), now_s=1.0)
    assert monitor.newly_unhealthy(1.0) == []
    found = monitor.newly_unhealthy(HEARTBEAT_TIMEOUT_S + 0.1)
    assert [w for w, _ in found] == [0]
    assert "no heartbeat for 1.6s" == found[0][1]
    assert monitor.newly_unhealthy(HEARTBEAT_TIMEOUT_S + 0.2) == []
    assert monitor.problems([0]) == []  # worker 1 still serves pool 0
    assert monitor.warnings() == [f"worker 0 unhealthy: {found[0][1]}"]
    assert monitor.is_healthy(1) and not monitor.is_healthy(0)


def test_detection_is_within_two_seconds_of_the_last_beat():
    monitor = HealthMonitor()
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    for tick in range(1, 11):  # beats every 0.5 s until t=5, then the worker stops
        monitor.on_heartbeat(Heartbeat(worker_id=0, time_s=0.0), now_s=tick * 0.5)
    now = 5.0
    while not monitor.newly_unhealthy(now):
        now += 0.1
    assert now - 5.0 <= 2.0


def test_pool_without_healthy_worker_is_a_problem():
    monitor = HealthMonitor()
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.add_worker(1, pool_id=1, now_s=0.0)
    monitor.on_heartbeat(Heartbeat(worker_id=1, time_s=0.0), now_s=5.0)
    monitor.newly_unhealthy(5.0)
    assert monitor.problems([0, 1]) == ["pool 0 has no healthy worker"]


def test_fatal_gpu_condition_in_a_heartbeat_is_unhealthy_at_once():
    monitor = HealthMonitor()
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.on_heartbeat(Heartbeat(worker_id=0, time_s=0.1, gpu={"fatal": "double-bit ECC"}),
                         now_s=0.1)
    assert monitor.newly_unhealthy(0.2) == [(0, "double-bit ECC")]


def test_a_hung_step_is_caught_while_the_heartbeat_still_beats():
    monitor = HealthMonitor(step_timeout_s=10.0)
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.on_step_sent(0, step_id=7, now_s=1.0)
    for tick in range(2, 12):
        monitor.on_heartbeat(Heartbeat(worker_id=0, time_s=0.0), now_s=float(tick))
        assert monitor.newly_unhealthy(float(tick)) == []
    monitor.on_heartbeat(Heartbeat(worker_id=0, time_s=0.0), now_s=11.5)
    (worker_id, reason), = monitor.newly_unhealthy(11.5)
    assert worker_id == 0 and reason.startswith("step 7 in flight for 10s (hung")


def test_a_step_that_returns_in_time_is_not_hung():
    monitor = HealthMonitor(step_timeout_s=10.0)
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.on_step_sent(0, step_id=1, now_s=0.0)
    monitor.on_progress(0, now_s=9.0)
    monitor.on_heartbeat(Heartbeat(worker_id=0, time_s=0.0), now_s=20.0)
    assert monitor.newly_unhealthy(20.0) == []
    assert monitor.table(20.0)[0]["step_age_s"] == 0.0


def test_a_step_queued_behind_another_is_timed_from_when_that_one_returns():
    """Overlap sends step 2 while step 1 runs: step 2's clock starts when step 1 is back, so
    a step 2 that hangs is caught, and one that does not is not."""
    monitor = HealthMonitor(step_timeout_s=10.0)
    monitor.add_worker(0, pool_id=0, now_s=0.0)
    monitor.on_step_sent(0, step_id=1, now_s=0.0)
    monitor.on_step_sent(0, step_id=2, now_s=0.0)
    monitor.on_progress(0, now_s=8.0)  # step 1 back; step 2 starts
    monitor.on_heartbeat(Heartbeat(worker_id=0, time_s=0.0), now_s=17.0)
    assert monitor.newly_unhealthy(17.0) == [] and monitor.table(17.0)[0]["step_age_s"] == 9.0
    monitor.on_heartbeat(Heartbeat(worker_id=0, time_s=0.0), now_s=18.5)
    (worker_id, reason), = monitor.newly_unhealthy(18.5)
    assert worker_id == 0 and reason.startswith("step 2 in flight for 10s (hung")


def test_first_fatal_report_wins_and_a_rejoin_starts_a_fresh_row():
    monitor = HealthMonitor()
    monitor.add_worker(0, pool_id=0, now_s=0.0, pid=100, device="cuda:0")
    monitor.report_fatal(0, "process 100 exited")
    monitor.report_fatal(0, "unreachable")
    assert monitor.newly_unhealthy(0.1) == [(0, "process 100 exited")]
    monitor.add_worker(0, pool_id=0, now_s=5.0, pid=200, device="cuda:0")
    row = monitor.table(5.0)[0]
    assert row["healthy"] and row["pid"] == 200 and row["num_restarts"] == 1 and not row["reason"]


def test_table_rows_are_flat_with_process_pool_and_gpu_figures():
    monitor = HealthMonitor()
    monitor.add_worker(3, pool_id=1, now_s=0.0, pid=42, device="cuda:1")
    pool = {"kind": "cuda_ipc", "num_blocks": 8, "is_mapped": True}
    monitor.on_heartbeat(Heartbeat(worker_id=3, time_s=0.0, rss_bytes=2048, cpu_time_s=1.23456,
                                   gpu={"memory_allocated_bytes": 99}, pool=pool), now_s=1.0)
    monitor.on_gpu_reading(3, {"temperature_c": 64.0, "ecc_uncorrected": 0})
    row = monitor.table(1.25)[0]
    assert row["rss_bytes"] == 2048 and row["cpu_time_s"] == 1.235
    assert row["heartbeat_age_s"] == 0.25 and row["pool"] == pool
    assert row["gpu_memory_allocated_bytes"] == 99 and row["gpu_temperature_c"] == 64.0
    assert row["device"] == "cuda:1" and row["pid"] == 42
