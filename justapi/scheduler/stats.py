"""Flat numeric figures for /metrics, read from the scheduler state (O(pools + workers)).

Names: gauges `num_requests_running|waiting`, `kv_usage` (blocks held by requests / all
blocks; cached blocks nobody holds count as free, as in vLLM), `prefix_cache_blocks`;
counters `prefix_cache_hits|misses` (blocks), `prefix_cache_query_tokens|hit_tokens`
(tokens, for vLLM-style prefix_cache_queries/hits), `num_preemptions`, `num_*_tokens`, ...,
`spec_decode_*` with speculative decoding (justapi/scheduler/spec/speculation.py);
per worker `worker_<id>_<name>` and per pool `pool_<id>_<name>`.
Owns: the names. Does not own: the counters themselves (SchedulerState.counters).
"""
from __future__ import annotations

import dataclasses

from justapi.scheduler.state import SchedulerState


def collect_stats(state: SchedulerState) -> dict[str, float]:
    out: dict[str, float] = {}
    pool = state.pool
    num_blocks = sum(pool.num_blocks(p) for p in pool.pool_ids)
    in_use = sum(pool.num_in_use(p) for p in pool.pool_ids)
    out["num_requests_running"] = sum(len(r) for r in state.pool_running.values())
    out["num_requests_waiting"] = sum(len(q) for q in state.queues.values())
    out["num_steps_in_flight"] = sum(len(w.in_flight) for w in state.workers.values())
    out["num_workers_healthy"] = sum(w.is_healthy for w in state.workers.values())
    out["kv_usage"] = in_use / num_blocks if num_blocks else 0.0
    out["kv_blocks_total"] = num_blocks
    out["kv_blocks_in_use"] = in_use
    out["kv_blocks_free"] = sum(pool.num_free(p) for p in pool.pool_ids)
    out.update(_prefix_cache_stats(state))
    out.update({name: float(value) for name, value in dataclasses.asdict(state.counters).items()})
    if state.spec is not None:
        out.update(state.spec.counters.as_stats())
    for worker in state.workers.values():
        prefix = f"worker_{worker.worker_id}_"
        out[prefix + "num_requests_running"] = len(worker.running)
        out[prefix + "is_healthy"] = float(worker.is_healthy)
        out[prefix + "is_busy"] = float(bool(worker.in_flight))
        out[prefix + "is_draining"] = float(worker.is_draining)
        out[prefix + "num_steps"] = worker.num_steps
        out[prefix + "num_scheduled_tokens"] = worker.num_scheduled_tokens
    for pool_id in pool.pool_ids:
        prefix = f"pool_{pool_id}_"
        out[prefix + "num_requests_waiting"] = len(state.queues[pool_id])
        out[prefix + "num_requests_running"] = len(state.pool_running[pool_id])
        out[prefix + "kv_usage"] = pool.num_in_use(pool_id) / pool.num_blocks(pool_id)
        out[prefix + "kv_blocks_free"] = pool.num_free(pool_id)
        out[prefix + "prefix_cache_blocks"] = pool.num_cached(pool_id)
    return out


def _prefix_cache_stats(state: SchedulerState) -> dict[str, float]:
    caches = state.kv.caches.values()
    hits = sum(c.stats.hits for c in caches)
    misses = sum(c.stats.misses for c in caches)
    return {
        "prefix_cache_hits": hits,
        "prefix_cache_misses": misses,
        "prefix_cache_hit_ratio": hits / (hits + misses) if hits + misses else 0.0,
        "prefix_cache_blocks": sum(c.num_blocks for c in caches),
        "prefix_cache_query_tokens": sum(c.stats.query_tokens for c in caches),
        "prefix_cache_hit_tokens": sum(c.stats.hit_tokens for c in caches),
    }
