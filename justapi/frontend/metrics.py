"""Prometheus metrics of the frontend, in its own CollectorRegistry, rendered for /metrics.

Token counters and latency histograms are measured here from each request's deltas (like
vLLM); gauges and scheduler totals are read from the latest SchedulerStats snapshot at
scrape time, and totals stay monotonic across a scheduler restart. Every metric carries a
`model_name` label. Owns: metric definitions and their registry. Does not own: the snapshot
(EngineClient keeps it) nor what the scheduler counts (justapi/scheduler/).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from justapi.frontend.failure_metrics import RequestFailures
from justapi.frontend.monotonic import MonotonicTotal
from justapi.frontend.router_metrics import RouterGaugesCollector
from justapi.frontend.structured_replies import StructuredMetrics
from justapi.wire.protocol import SchedulerStats

PREFIX = "justapi:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


@dataclass(frozen=True)
class StatMetric:
    """One scheduler figure (a key of the scheduler core's stats()) exported as a metric."""

    name: str
    doc: str
    stat_key: str
    is_counter: bool = False


# Keys as justapi/scheduler/stats.py reports them.
SCHEDULER_METRICS = (
    StatMetric(PREFIX + "num_requests_running", "Requests running (scheduled on a worker).",
               "num_requests_running"),
    StatMetric(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
               "num_requests_waiting"),
    StatMetric(PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
               "kv_usage"),
    StatMetric("prefix_cache_hit_ratio", "Prefix cache hits / lookups, counted in blocks.",
               "prefix_cache_hit_ratio"),
    StatMetric("prefix_cache_blocks", "Blocks held by the prefix cache.", "prefix_cache_blocks"),
    StatMetric("prefix_cache_hits", "Prefix cache block lookups that hit.",
               "prefix_cache_hits", is_counter=True),
    StatMetric("prefix_cache_misses", "Prefix cache block lookups that missed.",
               "prefix_cache_misses", is_counter=True),
    StatMetric(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
               "prefix_cache_query_tokens", is_counter=True),
    StatMetric(PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
               "prefix_cache_hit_tokens", is_counter=True),
    StatMetric(PREFIX + "num_preemptions", "Requests preempted (blocks freed, re-queued).",
               "num_preemptions", is_counter=True),
    StatMetric(PREFIX + "num_step_retries", "Requests of a step the worker failed re-queued "
               "instead of failed with it (one at a time until the cause fails alone).",
               "num_step_retries", is_counter=True),
    StatMetric(PREFIX + "num_multi_step_plans", "Plans that ran several decode steps without a "
               "round trip (--decode-steps).", "num_multi_step_plans", is_counter=True),
    StatMetric(PREFIX + "num_long_rope_recomputes", "LongRoPE sequences recomputed with the "
               "long table on outgrowing the original context.", "num_long_rope_recomputes",
               is_counter=True),
)
# PD disaggregation (--pd P:D; justapi/scheduler/pd/stats.py): absent from a colocated snapshot.
PD_METRICS = (
    StatMetric(PREFIX + "pd_handoffs", "Requests handed from a prefill to a decode worker.",
               "pd_num_handoffs", is_counter=True),
    StatMetric(PREFIX + "pd_handoff_blocks", "KV blocks handed off (zero-copy or copied).",
               "pd_handoff_blocks", is_counter=True),
    StatMetric(PREFIX + "pd_handoff_bytes", "KV bytes handed off (zero-copy or copied).",
               "pd_handoff_bytes", is_counter=True),
    StatMetric(PREFIX + "pd_copies", "Hand-offs copied between KV pools.", "pd_num_copies",
               is_counter=True),
    StatMetric(PREFIX + "pd_copied_blocks", "KV blocks copied between pools.",
               "pd_copied_blocks", is_counter=True),
    StatMetric(PREFIX + "pd_copied_bytes", "KV bytes copied between pools.", "pd_copied_bytes",
               is_counter=True),
    StatMetric(PREFIX + "pd_leases_expired", "Hand-offs taken back unclaimed (recomputed).",
               "pd_num_leases_expired", is_counter=True),
    StatMetric(PREFIX + "pd_handoffs_pending", "Hand-offs not yet claimed by a decode worker.",
               "pd_num_handoffs_pending"),
    StatMetric(PREFIX + "pd_copies_in_flight", "Hand-off copies ordered and not acknowledged.",
               "pd_num_copies_in_flight"),
)
# Speculative decoding (justapi/scheduler/spec/speculation.py): vLLM's spec_decode counters, plus
# the acceptance figures llama.cpp's server reports (draft acceptance rate) as gauges.
SPEC_METRICS = (
    StatMetric(PREFIX + "spec_decode_num_drafts", "Verifications of draft tokens (one per "
               "request and step with drafts).", "spec_decode_num_drafts", is_counter=True),
    StatMetric(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified.",
               "spec_decode_num_draft_tokens", is_counter=True),
    StatMetric(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
               "spec_decode_num_accepted_tokens", is_counter=True),
    StatMetric(PREFIX + "spec_decode_mean_acceptance_length", "Tokens per verification: 1 + "
               "accepted / drafts.", "spec_decode_mean_acceptance_length"),
    StatMetric(PREFIX + "spec_decode_draft_acceptance_rate", "Accepted / verified draft tokens.",
               "spec_decode_draft_acceptance_rate"),
)
# Workers on several hosts (--launcher ray; justapi/scheduler/cluster/imports.py).
CLUSTER_METRICS = (
    StatMetric(PREFIX + "kv_imports", "Cached prefixes copied in from another host's pool "
               "instead of recomputed.", "kv_imports", is_counter=True),
    StatMetric(PREFIX + "kv_import_bytes", "KV bytes of prefix imports.", "kv_import_bytes",
               is_counter=True),
    StatMetric(PREFIX + "kv_import_failures", "Prefix imports that failed (recomputed).",
               "kv_import_failures", is_counter=True),
    StatMetric(PREFIX + "kv_imports_in_flight", "Prefix imports ordered, not acknowledged.",
               "kv_imports_in_flight"),
    StatMetric(PREFIX + "num_hosts", "Hosts with a KV pool.", "num_hosts"),
)
SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
SPEC_POS_KEY = "spec_decode_num_accepted_tokens_pos_"
PD_SIDES = ("prefill", "decode")
PD_SIDE_GAUGES = (  # stats key pd_<side>_<key>, labelled pool="prefill"|"decode"
    ("num_requests_waiting", "pd_pool_num_requests_waiting",
     "Queue depth: waiting requests (prefill) or unclaimed hand-offs (decode)."),
    ("num_requests_running", "pd_pool_num_requests_running", "Requests running on the side."),
    ("num_workers_healthy", "pd_pool_num_workers_healthy", "Healthy workers of the side."),
    ("seq_occupancy", "pd_pool_seq_occupancy", "Running requests / (healthy workers * max-seqs)."),
    ("kv_usage", "pd_pool_kv_cache_usage_perc", "Fraction of the side's KV blocks in use."),
)
PD_HANDOFF_LATENCY = "pd_handoff_latency_seconds"
WORKER_LABELS = ["model_name", "worker_id"]
# The scheduler's health table (justapi/health/table.py rows: process, pool and NVML figures), one
# gauge per figure and worker; a figure a worker lacks (no GPU, no NVML) is left out.
HEALTH_GAUGES = (
    ("rss_bytes", "worker_resident_memory_bytes", "Resident memory of the worker process."),
    ("cpu_time_s", "worker_cpu_seconds", "CPU time used by the worker process."),
    ("heartbeat_age_s", "worker_heartbeat_age_seconds", "Time since the worker's last heartbeat."),
    ("step_age_s", "worker_step_age_seconds", "Time the worker's step has been in flight."),
    ("num_restarts", "worker_restarts", "Times the worker rejoined after its process died."),
    ("draining", "worker_draining", "1 while the worker is drained (admits nothing new)."),
    ("gpu_temperature_c", "gpu_temperature_celsius", "GPU temperature (NVML)."),
    ("gpu_memory_used_bytes", "gpu_memory_used_bytes", "GPU memory used (NVML)."),
    ("gpu_memory_total_bytes", "gpu_memory_total_bytes", "GPU memory in all (NVML)."),
    ("gpu_utilization_percent", "gpu_utilization_percent", "GPU utilisation (NVML)."),
    ("gpu_power_watts", "gpu_power_watts", "GPU power draw (NVML)."),
    ("gpu_is_thermal_throttled", "gpu_thermal_throttled", "1 while clocks are thermally throttled."),
    ("gpu_ecc_corrected", "gpu_ecc_corrected_errors", "Volatile corrected ECC errors (NVML)."),
    ("gpu_ecc_uncorrected", "gpu_ecc_uncorrected_errors", "Volatile uncorrected ECC errors."),
)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


class SchedulerStatsCollector(Collector):
    """Reads the latest SchedulerStats at scrape time; figures it lacks are left out."""

    def __init__(self, model_name: str, source: Callable[[], SchedulerStats | None],
                 restarts: Callable[[], int] = lambda: 0) -> None:
        self._model_name = model_name
        self._source = source
        self._restarts = restarts
        self._totals = {m.name: MonotonicTotal() for m in SCHEDULER_METRICS + PD_METRICS
                        + SPEC_METRICS + CLUSTER_METRICS if m.is_counter}
        self._position_totals: dict[str, MonotonicTotal] = {}
        self._worker_totals: dict[tuple[str, str], MonotonicTotal] = {}

    def collect(self) -> Iterator[Metric]:
        snapshot = self._source()
        healthy = GaugeMetricFamily(PREFIX + "scheduler_healthy",
                                    "1 when the scheduler reports itself healthy.",
                                    labels=["model_name"])
        healthy.add_metric([self._model_name], float(bool(snapshot and snapshot.healthy)))
        yield healthy
        restarts = CounterMetricFamily(PREFIX + "scheduler_restarts", "Schedulers that took "
                                       "the open requests over after one died.",
                                       labels=["model_name"])
        restarts.add_metric([self._model_name], float(self._restarts()))
        yield restarts
        if snapshot is None:
            return
        yield from self._scheduler_figures(snapshot.stats)
        yield from self._worker_figures(snapshot)
        yield from self._health_figures(snapshot)
        yield from self._host_figures(snapshot)
        yield from self._pd_figures(snapshot.stats)
        yield from self._spec_figures(snapshot.stats)

    def _scheduler_figures(self, stats: dict) -> Iterator[Metric]:
        for spec in SCHEDULER_METRICS + PD_METRICS + SPEC_METRICS + CLUSTER_METRICS:
            value = _number(stats.get(spec.stat_key))
            if value is None:
                continue
            family: Metric
            if spec.is_counter:
                family = CounterMetricFamily(spec.name, spec.doc, labels=["model_name"])
                value = self._totals[spec.name].update(value)
            else:
                family = GaugeMetricFamily(spec.name, spec.doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family

    def _worker_figures(self, snapshot: SchedulerStats) -> Iterator[Metric]:
        """Per worker: running requests (`worker_<id>_num_requests_running`), the KV usage of
        its pool (`pool_<pool_id>_kv_usage`) and the health verdict of the scheduler's table."""
        running = GaugeMetricFamily(PREFIX + "worker_num_requests_running",
                                    "Requests running on a worker.", labels=WORKER_LABELS)
        kv_usage = GaugeMetricFamily(PREFIX + "worker_kv_cache_usage_perc",
                                     "Fraction of the KV pool a worker uses that is in use "
                                     "(workers sharing one pool report the same value).",
                                     labels=WORKER_LABELS)
        healthy = GaugeMetricFamily(PREFIX + "worker_healthy",
                                    "1 when the scheduler considers the worker healthy.",
                                    labels=WORKER_LABELS)
        steps = CounterMetricFamily(PREFIX + "worker_steps", "Steps a worker has been sent.",
                                    labels=WORKER_LABELS)
        tokens = CounterMetricFamily(PREFIX + "worker_scheduled_tokens",
                                     "Tokens (prefill chunks, decodes, drafts) a worker's steps "
                                     "carried: how the load is spread.", labels=WORKER_LABELS)
        stats = snapshot.stats
        for worker in snapshot.workers:
            if not isinstance(worker, dict) or "worker_id" not in worker:
                continue
            worker_id = worker["worker_id"]
            labels = [self._model_name, str(worker_id)]
            for family, value in (
                    (running, stats.get(f"worker_{worker_id}_num_requests_running")),
                    (kv_usage, stats.get(f"pool_{worker.get('pool_id')}_kv_usage")),
                    (healthy, worker.get("healthy"))):
                if _number(value) is not None:
                    family.add_metric(labels, float(value))  # type: ignore[arg-type]
            for counter, key in ((steps, "num_steps"), (tokens, "num_scheduled_tokens")):
                count = _number(stats.get(f"worker_{worker_id}_{key}"))
                if count is not None:
                    total = self._worker_totals.setdefault((counter.name, str(worker_id)),
                                                           MonotonicTotal())
                    counter.add_metric(labels, total.update(count))
        families: tuple[Metric, ...] = (running, kv_usage, healthy, steps, tokens)
        for metric in families:
            if metric.samples:
                yield metric

    def _health_figures(self, snapshot: SchedulerStats) -> Iterator[Metric]:
        rows = [w for w in snapshot.workers if isinstance(w, dict) and "worker_id" in w]
        for key, name, doc in HEALTH_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=WORKER_LABELS)
            for row in rows:
                value = row.get(key)
                if isinstance(value, bool) or _number(value) is not None:
                    family.add_metric([self._model_name, str(row["worker_id"])],
                                      float(value))  # type: ignore[arg-type]
            if family.samples:
                yield family


    def _host_figures(self, snapshot: SchedulerStats) -> Iterator[Metric]:
        """--launcher ray: workers and healthy workers per host (label `host`)."""
        rows = [w for w in snapshot.workers if isinstance(w, dict) and w.get("host")]
        if not rows:
            return
        total = GaugeMetricFamily(PREFIX + "host_workers", "Workers placed on a host.",
                                  labels=["model_name", "host"])
        healthy = GaugeMetricFamily(PREFIX + "host_workers_healthy",
                                    "Healthy workers on a host (0: the host is lost).",
                                    labels=["model_name", "host"])
        for host in sorted({str(w["host"]) for w in rows}):
            mine = [w for w in rows if w["host"] == host]
            total.add_metric([self._model_name, host], float(len(mine)))
            healthy.add_metric([self._model_name, host], float(sum(bool(w.get("healthy"))
                                                                   for w in mine)))
        yield total
        yield healthy

    def _pd_figures(self, stats: dict) -> Iterator[Metric]:
        """Per PD side gauges, and the hand-off latency histogram (`<name>_bucket:<le>`
        cumulative counts, `_sum`, `_count` in the snapshot)."""
        for key, name, doc in PD_SIDE_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "pool"])
            for side in PD_SIDES:
                value = _number(stats.get(f"pd_{side}_{key}"))
                if value is not None:
                    family.add_metric([self._model_name, side], value)
            if family.samples:
                yield family
        name = PD_HANDOFF_LATENCY
        if _number(stats.get(f"{name}_count")) is None:
            return
        marker = f"{name}_bucket:"
        buckets = sorted(((key[len(marker):], float(value)) for key, value in stats.items()
                          if key.startswith(marker)), key=lambda b: float(b[0]))
        latency = HistogramMetricFamily(PREFIX + PD_HANDOFF_LATENCY,
                                        "Prefill done to decode worker's claim of a hand-off.",
                                        labels=["model_name"])
        latency.add_metric([self._model_name], buckets, float(stats.get(f"{name}_sum", 0.0)))
        yield latency


    def _spec_figures(self, stats: dict) -> Iterator[Metric]:
        """Accepted draft tokens by position in the accepted path (vLLM's per_pos counter)."""
        family = CounterMetricFamily(PREFIX + SPEC_PER_POS, "Draft tokens accepted, by their "
                                     "position in the accepted path (0 = first draft).",
                                     labels=["model_name", "position"])
        for key, value in stats.items():
            if key.startswith(SPEC_POS_KEY) and _number(value) is not None:
                position = key[len(SPEC_POS_KEY):]
                total = self._position_totals.setdefault(position, MonotonicTotal())
                family.add_metric([self._model_name, position], total.update(float(value)))
        if family.samples:
            yield family


class RequestTimer:
    """One request's latency and token accounting, fed from its deltas as they arrive."""

    __slots__ = ("_metrics", "_arrival_s", "_last_s", "_num_prompt_tokens", "num_output_tokens")

    def __init__(self, metrics: FrontendMetrics, num_prompt_tokens: int, arrival_s: float) -> None:
        self._metrics = metrics
        self._arrival_s = arrival_s
        self._last_s: float | None = None
        self._num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0

    def on_tokens(self, num_tokens: int, now_s: float | None = None) -> None:
        """Observe TTFT on the first tokens, then one inter-token latency per token (a
        coalesced delta of k tokens after a gap g counts k gaps of g / k)."""
        if num_tokens <= 0:
            return
        now = time.perf_counter() if now_s is None else now_s
        metrics = self._metrics
        if self._last_s is None:
            metrics.time_to_first_token.observe(now - self._arrival_s)
            metrics.prompt_tokens.inc(self._num_prompt_tokens)
            gaps = num_tokens - 1  # tokens after the first in the same delta arrived with it
            gap_s = 0.0
        else:
            gaps = num_tokens
            gap_s = (now - self._last_s) / num_tokens
        for _ in range(gaps):
            metrics.inter_token_latency.observe(gap_s)
        metrics.generation_tokens.inc(num_tokens)
        self.num_output_tokens += num_tokens
        self._last_s = now

    def on_finish(self, finish_reason: str, now_s: float | None = None) -> None:
        now = time.perf_counter() if now_s is None else now_s
        metrics = self._metrics
        if self._last_s is None:  # finished without a token: its prompt was still processed
            metrics.prompt_tokens.inc(self._num_prompt_tokens)
        metrics.e2e_request_latency.observe(now - self._arrival_s)
        metrics.request_success.labels(metrics.model_name, finish_reason or "unknown").inc()

    def on_failure(self, stage: str) -> None:
        """The request failed on its own in the frontend's `stage` (failure_metrics.py)."""
        self._metrics.failures.count(stage)


class FrontendMetrics:
    """The frontend's metrics: request counters/histograms plus the scheduler snapshot."""

    def __init__(self, model_name: str,
                 stats_source: Callable[[], SchedulerStats | None] = lambda: None,
                 restarts_source: Callable[[], int] = lambda: 0) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         labels, registry=reg).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success",
                                       "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first generated token.",
            labels, buckets=TTFT_BUCKETS_S, registry=reg).labels(model_name)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between generated tokens.",
            labels, buckets=ITL_BUCKETS_S, registry=reg).labels(model_name)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
            labels, buckets=E2E_BUCKETS_S, registry=reg).labels(model_name)
        reg.register(SchedulerStatsCollector(model_name, stats_source, restarts_source))
        self.failures = RequestFailures(model_name, stats_source)  # by stage (faults.py)
        reg.register(self.failures)
        reg.register(RouterGaugesCollector(model_name, stats_source))  # vllm: names
        self.structured = StructuredMetrics(reg, model_name, PREFIX)

    def start_request(self, num_prompt_tokens: int, arrival_s: float | None = None) -> RequestTimer:
        """arrival_s is a time.perf_counter() reading; default now."""
        arrival = time.perf_counter() if arrival_s is None else arrival_s
        return RequestTimer(self, num_prompt_tokens, arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
