"""`justapi:request_failures_total{stage}`: requests that failed on their own, by stage.

The scheduler counts the stages it runs (admit, plan, mask, results:
justapi/scheduler/faults.py) and reports them in its stats (`request_failures_<stage>`);
the frontend counts its own (detokenize) here. One family, both sources, each total monotonic
across a scheduler restart. Owns: the frontend's counts and the family. Does not own: the
scheduler's counts (read from the latest snapshot).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from justapi.frontend.monotonic import MonotonicTotal
from justapi.wire.protocol import SchedulerStats

NAME = "justapi:request_failures"
SCHEDULER_STAGES = ("admit", "plan", "mask", "results")
FRONTEND_STAGES = ("detokenize",)
STAT_PREFIX = "request_failures_"  # as justapi/scheduler/faults.py names its stats


class RequestFailures(Collector):
    def __init__(self, model_name: str, source: Callable[[], SchedulerStats | None]) -> None:
        self._model_name = model_name
        self._source = source
        self._totals = {stage: MonotonicTotal() for stage in SCHEDULER_STAGES}
        self.counts = dict.fromkeys(FRONTEND_STAGES, 0)

    def count(self, stage: str) -> None:
        """One request failed in the frontend's `stage`."""
        self.counts[stage] += 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(NAME, "Requests that failed on their own (the others kept "
                                     "being served), by the stage that failed them.",
                                     labels=["model_name", "stage"])
        snapshot = self._source()
        stats = snapshot.stats if snapshot is not None else {}
        for stage, total in self._totals.items():
            value = stats.get(STAT_PREFIX + stage)
            if isinstance(value, (int, float)):
                family.add_metric([self._model_name, stage], total.update(float(value)))
        for stage, count in self.counts.items():
            family.add_metric([self._model_name, stage], float(count))
        yield family
