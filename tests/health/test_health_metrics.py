"""The health table on /metrics (process, pool and NVML figures as per-worker gauges) and the
details /health adds to its verdict (warnings, each worker's state)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from justapi.frontend.api_server import _health_details
from justapi.frontend.metrics import FrontendMetrics
from justapi.frontend.openai_models import HealthResponse
from justapi.wire.protocol import SchedulerStats

GPU_ROW = {"worker_id": 0, "pool_id": 0, "pid": 11, "device": "cuda:0", "healthy": False,
           "reason": "GPU cuda:0 reported XID 79 (GPU has fallen off the bus)",
           "heartbeat_age_s": 0.25, "step_age_s": 0.0, "rss_bytes": 3 << 30, "cpu_time_s": 12.5,
           "num_restarts": 2, "draining": False, "gpu_temperature_c": 83.0,
           "gpu_memory_used_bytes": 70 << 30, "gpu_memory_total_bytes": 80 << 30,
           "gpu_utilization_percent": 97.0, "gpu_power_watts": 640.5,
           "gpu_is_thermal_throttled": True, "gpu_ecc_corrected": 4, "gpu_ecc_uncorrected": 1,
           "gpu_throttle_reasons": ["sw_thermal_slowdown"], "gpu_xids": [79], "pool": {}}
CPU_ROW = {"worker_id": 1, "pool_id": 1, "healthy": True, "reason": "", "rss_bytes": 1 << 20,
           "cpu_time_s": 1.0, "heartbeat_age_s": 0.1, "step_age_s": 0.05, "num_restarts": 0,
           "draining": True, "pool": {"kind": "shm"}}
SNAPSHOT = SchedulerStats(time_s=0.0, healthy=True, stats={}, workers=[GPU_ROW, CPU_ROW],
                          warnings=["worker 0 unhealthy: GPU cuda:0 reported XID 79 (GPU has "
                                    "fallen off the bus)", "worker 1 is draining"])


def samples(metrics: FrontendMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, sample.labels.get("worker_id", ""))] = sample.value
    return out


def test_health_figures_are_per_worker_gauges():
    found = samples(FrontendMetrics("m", lambda: SNAPSHOT))
    assert found[("justapi:worker_resident_memory_bytes", "0")] == 3 << 30
    assert found[("justapi:worker_resident_memory_bytes", "1")] == 1 << 20
    assert found[("justapi:worker_cpu_seconds", "0")] == 12.5
    assert found[("justapi:worker_heartbeat_age_seconds", "1")] == 0.1
    assert found[("justapi:worker_step_age_seconds", "1")] == 0.05
    assert found[("justapi:worker_restarts", "0")] == 2
    assert found[("justapi:worker_draining", "1")] == 1 and found[("justapi:worker_draining", "0")] == 0
    assert found[("justapi:gpu_temperature_celsius", "0")] == 83.0
    assert found[("justapi:gpu_memory_used_bytes", "0")] == 70 << 30
    assert found[("justapi:gpu_memory_total_bytes", "0")] == 80 << 30
    assert found[("justapi:gpu_utilization_percent", "0")] == 97.0
    assert found[("justapi:gpu_power_watts", "0")] == 640.5
    assert found[("justapi:gpu_thermal_throttled", "0")] == 1
    assert found[("justapi:gpu_ecc_corrected_errors", "0")] == 4
    assert found[("justapi:gpu_ecc_uncorrected_errors", "0")] == 1
    assert ("justapi:gpu_temperature_celsius", "1") not in found  # a CPU worker has none
    assert found[("justapi:worker_healthy", "0")] == 0


def test_health_details_list_warnings_and_workers():
    details = _health_details(SNAPSHOT)
    body = HealthResponse.model_validate({"status": "degraded", "problems": [], **details})
    assert body.warnings == SNAPSHOT.warnings
    assert [(w.worker_id, w.healthy, w.draining) for w in body.workers] == [(0, False, False),
                                                                          (1, True, True)]
    assert body.workers[0].reason.startswith("GPU cuda:0 reported XID 79")
    assert _health_details(None) == {"warnings": [], "workers": []}
