"""Text report of a simulation: summary, latency percentiles, per-request rows.

Owns: formatting only. Does not own: the figures (SimResult).
"""
from __future__ import annotations

from justapi.scheduler.sim.records import SimResult

LATENCIES = (("queue", "queue_s", "queue_steps"), ("TTFT", "ttft_s", "ttft_steps"),
             ("TPOT", "tpot_s", "tpot_steps"))


def format_summary(label: str, result: SimResult, max_seqs: int, max_batched_tokens: int) -> str:
    s = result.summary(max_seqs, max_batched_tokens)
    lines = [
        f"== {label}",
        f"requests {s['requests']:.0f} (finished {s['finished']:.0f}, rejected {s['rejected']:.0f});"
        f" steps {s['steps']:.0f}; modelled time {s['duration_s']:.3f} s;"
        f" {s['output_tokens']:.0f} output tokens = {s['output_tokens_per_s']:.1f} tok/s",
        f"batch occupancy: {s['mean_seqs_per_step']:.2f} seqs/step ({100 * s['seq_occupancy']:.1f}%"
        f" of max-seqs), {100 * s['token_occupancy']:.1f}% of the token budget",
        f"prefix cache hit ratio {s['prefix_cache_hit_ratio']:.3f}; preemptions "
        f"{s['preemptions']:.0f}",
        f"{'':8s}{'p50':>12s}{'p90':>12s}{'p99':>12s}",
    ]
    for name, seconds, steps in LATENCIES:
        sec = result.percentiles(seconds)
        stp = result.percentiles(steps)
        lines.append(f"{name + ' s':8s}" + "".join(f"{sec[q]:12.4f}" for q in (50, 90, 99)))
        lines.append(f"{name + ' st':8s}" + "".join(f"{stp[q]:12.1f}" for q in (50, 90, 99)))
    return "\n".join(lines)


def format_requests(result: SimResult, limit: int) -> str:
    header = (f"{'request':>10s} {'prompt':>6s} {'out':>5s} {'cached':>6s} {'reason':>8s} "
              f"{'queue_s':>9s} {'ttft_s':>9s} {'tpot_s':>9s} {'queue_st':>8s} {'ttft_st':>7s} "
              f"{'tpot_st':>7s}")
    rows = [header]
    for record in list(result.records.values())[:limit]:
        rows.append(
            f"{record.request_id:>10s} {len(record.prompt):6d} {len(record.output):5d} "
            f"{record.num_cached_tokens:6d} {record.finish_reason:>8s} {_f(record.queue_s, 9, 4)} "
            f"{_f(record.ttft_s, 9, 4)} {_f(record.tpot_s, 9, 4)} {_f(record.queue_steps, 8, 0)} "
            f"{_f(record.ttft_steps, 7, 0)} {_f(record.tpot_steps, 7, 2)}")
    return "\n".join(rows)


def _f(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.{digits}f}"
