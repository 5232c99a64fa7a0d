"""PD disaggregation figures for /metrics: hand-off counters, a hand-off latency histogram, and
per side (prefill / decode workers) queue depth and occupancy.

Names (all prefixed `pd_`): counters `num_handoffs`, `handoff_blocks`, `handoff_bytes` (KV
handed over, both paths), `num_copies`, `copied_blocks`, `copied_bytes` (the copy path only),
`num_leases_expired`, `num_copy_errors`; gauges `num_handoffs_pending`, `num_copies_in_flight`;
per side `<side>_num_requests_waiting` (prefill: the pools' waiting queues; decode: hand-offs
not yet claimed), `<side>_num_requests_running`, `<side>_num_workers_healthy`,
`<side>_seq_occupancy` (running / (healthy workers * max_seqs)), `<side>_kv_usage` (of the
pools the side's workers map); the histogram `handoff_latency_seconds` as
`..._bucket:<le>` (cumulative), `..._sum`, `..._count`.
Owns: those names and the histogram. Does not own: when they change (pd_handoffs.py).
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

from justapi.scheduler.state import SchedulerState
from justapi.scheduler.topology import ROLE_DECODE, ROLE_PREFILL

PREFIX = "pd_"
HANDOFF_LATENCY = "handoff_latency_seconds"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0)


@dataclass
class PdCounters:
    """Monotonic totals since start."""

    num_handoffs: int = 0
    handoff_blocks: int = 0
    handoff_bytes: int = 0
    num_copies: int = 0
    copied_blocks: int = 0
    copied_bytes: int = 0
    num_leases_expired: int = 0
    num_copy_errors: int = 0


@dataclass
class LatencyHistogram:
    """Prometheus-style histogram: per-bucket counts (not cumulative), sum and count."""

    buckets_s: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets_s) + 1)  # the last one is +Inf

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.buckets_s, value_s)] += 1
        self.sum_s += value_s
        self.count += 1

    def as_stats(self, name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        total = 0
        for le, num in zip([*map(repr, self.buckets_s), "+Inf"], self.counts):
            total += num
            out[f"{name}_bucket:{le}"] = float(total)
        out[f"{name}_sum"] = self.sum_s
        out[f"{name}_count"] = float(self.count)
        return out


def collect_pd_stats(state: SchedulerState, counters: PdCounters,
                     latency: LatencyHistogram) -> dict[str, float]:
    out = {PREFIX + name: float(value) for name, value in dataclasses.asdict(counters).items()}
    handoffs = state.handoffs
    out[PREFIX + "num_handoffs_pending"] = float(len(handoffs))
    out[PREFIX + "num_copies_in_flight"] = float(len(handoffs.copies))
    for role in (ROLE_PREFILL, ROLE_DECODE):
        out.update(_side_stats(state, role))
    out.update(latency.as_stats(PREFIX + HANDOFF_LATENCY))
    return out


def _side_stats(state: SchedulerState, role: str) -> dict[str, float]:
    workers = [w for w in state.workers.values() if w.role == role]
    healthy = [w for w in workers if w.is_healthy]
    pool_ids = sorted({w.pool_id for w in workers})
    pool = state.pool
    if role == ROLE_PREFILL:
        waiting = sum(len(state.queues[p]) for p in pool_ids)
    else:
        waiting = len(state.handoffs)
    running = sum(len(w.running) for w in workers)
    num_blocks = sum(pool.num_blocks(p) for p in pool_ids)
    prefix = f"{PREFIX}{role}_"
    return {
        prefix + "num_requests_waiting": float(waiting),
        prefix + "num_requests_running": float(running),
        prefix + "num_workers_healthy": float(len(healthy)),
        prefix + "seq_occupancy": running / (len(healthy) * state.config.max_seqs) if healthy else 0.0,
        prefix + "kv_usage": (sum(pool.num_in_use(p) for p in pool_ids) / num_blocks
                              if num_blocks else 0.0),
    }
