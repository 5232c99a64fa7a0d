"""The gauges cluster routers read on /metrics under vLLM's names (llm-d's endpoint picker,
the Gateway API Inference Extension's model-server protocol): queue depth, KV usage, and the
LoRA info gauge - empty here (no adapters), but present, as the picker expects it.

    vllm:num_requests_waiting   vllm:num_requests_running   vllm:kv_cache_usage_perc (0-1)
    vllm:lora_requests_info{running_lora_adapters="", waiting_lora_adapters="", max_lora="0"}
      = the snapshot's time (vLLM sets it to the time of its latest update)
Read from the latest SchedulerStats at scrape time, like the justapi: gauges they repeat.
Owns: those names. Does not own: the figures (justapi/scheduler/stats.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from justapi.wire.protocol import SchedulerStats

ROUTER_GAUGES = (
    ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
    ("vllm:num_requests_running", "Requests running on a worker.", "num_requests_running"),
    ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "kv_usage"),
)
LORA_INFO = "vllm:lora_requests_info"


class RouterGaugesCollector(Collector):
    def __init__(self, model_name: str, source: Callable[[], SchedulerStats | None]) -> None:
        self._model_name = model_name
        self._source = source

    def collect(self) -> Iterator[Metric]:
        snapshot = self._source()
        if snapshot is None:
            return
        for name, doc, key in ROUTER_GAUGES:
            value = snapshot.stats.get(key)
            if isinstance(value, (int, float)):
                family = GaugeMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self._model_name], float(value))
                yield family
        lora = GaugeMetricFamily(LORA_INFO, "Running and waiting LoRA adapters (none served).",
                                 labels=["model_name", "max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters"])
        lora.add_metric([self._model_name, "0", "", ""], float(snapshot.time_s))
        yield lora
