"""The gauges llm-d's endpoint picker reads, under vLLM's names, from the scheduler snapshot."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from justapi.frontend.metrics import FrontendMetrics
from justapi.wire.protocol import SchedulerStats


def test_router_gauges_repeat_the_snapshot_under_vllm_names():
    snapshot = SchedulerStats(time_s=1234.5, healthy=True, workers=[],
                              stats={"num_requests_waiting": 7, "num_requests_running": 3,
                                     "kv_usage": 0.25})
    text = FrontendMetrics("m", lambda: snapshot).render().decode()
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["vllm:num_requests_waiting"].value == 7
    assert samples["vllm:num_requests_running"].value == 3
    assert samples["vllm:kv_cache_usage_perc"].value == 0.25
    assert samples["vllm:num_requests_waiting"].labels == {"model_name": "m"}
    lora = samples["vllm:lora_requests_info"]
    assert lora.value == 1234.5
    assert lora.labels == {"model_name": "m", "max_lora": "0", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}


def test_no_snapshot_no_router_gauges():
    text = FrontendMetrics("m", lambda: None).render().decode()
    assert "vllm:" not in text
