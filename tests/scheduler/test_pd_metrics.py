"""PD figures of the scheduler snapshot as /metrics exports them: hand-off counters, per-side
queue depth and occupancy gauges (label pool="prefill"|"decode"), the latency histogram."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from justapi.frontend.metrics import FrontendMetrics
from justapi.scheduler.sim.harness import Harness, build_pd_scheduler, build_scheduler
from justapi.wire.protocol import PoolInfo, SchedulerStats

BLOCK_BYTES = 2 * 2 * 4 * 1 * 8 * 4  # layers x (K, V) x block_size x kv_heads x head_dim x fp32


def samples(stats: dict) -> dict[tuple[str, tuple], float]:
    snapshot = SchedulerStats(time_s=0.0, healthy=True, stats=stats, workers=[])
    text = FrontendMetrics("m", lambda: snapshot).render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def key(name: str, **labels: str) -> tuple[str, tuple]:
    return name, tuple(sorted({"model_name": "m", **labels}.items()))


def test_pd_snapshot_becomes_counters_gauges_and_a_histogram():
    core = build_pd_scheduler(pool_blocks=64, separate_pools=True)
    for pool_id in core.pool_ids():  # what the workers' Ready messages tell the factory
        core.set_pool_info(PoolInfo(pool_id, "shm", f"seg-{pool_id}", "cpu", "float32", 2, 64,
                                    4, 1, 8))
    h = Harness(core)
    h.tick(10.0)
    for i in range(3):
        h.submit(f"r{i}", [2 + i + j for j in range(9)], max_tokens=5, ignore_eos=True)
    h.step()  # three prefills done: three hand-offs waiting for their copies
    out = samples(h.scheduler.stats())
    assert out[key("justapi:pd_handoffs_total")] == 3
    assert out[key("justapi:pd_handoffs_pending")] == 3
    assert out[key("justapi:pd_pool_num_requests_waiting", pool="decode")] == 3
    assert out[key("justapi:pd_pool_num_workers_healthy", pool="prefill")] == 1
    h.tick(10.02)
    h.run()
    out = samples(h.scheduler.stats())
    assert out[key("justapi:pd_copied_blocks_total")] == 9  # 3 prompts of 9 tokens: 3 blocks
    assert out[key("justapi:pd_handoff_bytes_total")] == 9 * BLOCK_BYTES
    assert out[key("justapi:pd_copied_bytes_total")] == 9 * BLOCK_BYTES
    assert out[key("justapi:pd_handoff_latency_seconds_count")] == 3
    assert out[key("justapi:pd_handoff_latency_seconds_bucket", le="0.01")] == 0
    assert out[key("justapi:pd_handoff_latency_seconds_bucket", le="0.025")] == 3
    assert out[key("justapi:pd_handoff_latency_seconds_bucket", le="+Inf")] == 3
    assert abs(out[key("justapi:pd_handoff_latency_seconds_sum")] - 0.06) < 1e-9


def test_colocated_snapshot_has_no_pd_metrics():
    h = Harness(build_scheduler())
    h.submit("a", [3, 4, 5], max_tokens=2)
    h.run()
    assert not [name for name, _ in samples(h.scheduler.stats()) if "pd_" in name]
