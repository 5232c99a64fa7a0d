"""What `justapi bench serve` reports: percentiles, the summary (overall and per request
group), the summary table, the JSON report and the latency CDF plot.

Owns: statistics and output formats. Does not own: HTTP and timing (client.py), workloads
(workloads.py), flags (command.py). matplotlib is imported only to plot (the `bench` extra).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

from justapi.bench.client import BenchError, RequestRecord, RunResult

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                   ("E2E", "e2e_ms"))


# ---------------------------------------------------------------- statistics
def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics
    (numpy's default 'linear' method)."""
    if not samples:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(samples)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe_ms(samples_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/mean in milliseconds (None when there are no samples) and the count."""
    samples_ms = [s * 1000.0 for s in samples_s]
    stats: dict[str, float | int | None] = {
        f"p{q}": (percentile(samples_ms, q) if samples_ms else None) for q in PERCENTILES}
    stats["mean"] = sum(samples_ms) / len(samples_ms) if samples_ms else None
    stats["count"] = len(samples_ms)
    return stats


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs (over `duration_s`) and latency statistics of `records`."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "num_ok": len(done), "num_failed": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (prompt_tokens + output_tokens) * per_s,
        "total_output_tokens": output_tokens, "total_prompt_tokens": prompt_tokens,
        "ttft_ms": describe_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": describe_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": describe_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": describe_ms([r.e2e_s for r in done if r.e2e_s is not None]),
    }


def summarize_groups(records: Sequence[RequestRecord],
                     duration_s: float) -> dict[str, dict[str, Any]]:
    """A summary per request group (long-burst: 'decode' and 'burst'), in first-seen order."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(record.group, []).append(record)
    return {name: summarize(members, duration_s) for name, members in groups.items()}


# ---------------------------------------------------------------- reports
def format_summary(title: str, summary: dict[str, Any],
                   groups: dict[str, dict[str, Any]]) -> str:
    """The human-readable summary: counts, throughputs, then latency tables (ms)."""
    rows = [
        ("Requests ok / failed", f"{summary['num_ok']} / {summary['num_failed']}"),
        ("Duration (s)", f"{summary['duration_s']:.2f}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output tokens/s", f"{summary['output_throughput']:.1f}"),
        ("Total tokens/s", f"{summary['total_token_throughput']:.1f}"),
        ("Output / prompt tokens", f"{summary['total_output_tokens']} / "
                                   f"{summary['total_prompt_tokens']}"),
    ]
    lines = [f" {title} ".center(64, "=")]
    lines += [f"{name + ':':<36}{value:>28}" for name, value in rows]
    lines += latency_table("all requests", summary)
    if len(groups) > 1:
        for name, group in groups.items():
            lines += latency_table(f"group {name} ({group['num_ok']} ok)", group)
    return "\n".join(lines + ["=" * 64])


def latency_table(heading: str, summary: dict[str, Any]) -> list[str]:
    lines = [f" {heading} ".center(64, "-"),
             f"{'ms':<8}" + "".join(f"{c:>14}" for c in ("p50", "p90", "p99", "mean"))]
    for label, key in LATENCY_METRICS:
        stats = summary[key]
        cells = [stats[k] for k in ("p50", "p90", "p99", "mean")]
        lines.append(f"{label:<8}" + "".join(
            f"{'-' if c is None else format(c, '.2f'):>14}" for c in cells))
    return lines


def bench_json(config: dict[str, Any], result: RunResult) -> dict[str, Any]:
    """Everything a run measured: its configuration, summaries and per-request records."""
    return {"config": config, "interrupted": result.interrupted,
            "summary": summarize(result.records, result.duration_s),
            "groups": summarize_groups(result.records, result.duration_s),
            "requests": [asdict(record) for record in result.records]}


def error_counts(records: Sequence[RequestRecord], limit: int = 3) -> list[tuple[str, int]]:
    """The most common failure messages and their counts, so a broken run says why."""
    counts: dict[str, int] = {}
    for record in records:
        if record.error:
            counts[record.error] = counts.get(record.error, 0) + 1
    return sorted(counts.items(), key=lambda item: -item[1])[:limit]


# ---------------------------------------------------------------- the plot
def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install -e '.[bench]')") from None


def plot_cdf(path: str, records: Sequence[RequestRecord]) -> None:
    """Write the latency CDFs (TTFT, ITL, e2e; ms, log x) of the finished requests."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    done = [r for r in records if r.ok]
    series = {"TTFT": [r.ttft_s for r in done if r.ttft_s is not None],
              "ITL": [gap for r in done for gap in r.itl_s],
              "E2E": [r.e2e_s for r in done if r.e2e_s is not None]}
    figure, axes = plt.subplots(figsize=(8, 5))
    for label, samples_s in series.items():
        samples_ms = sorted(max(s * 1000.0, 1e-3) for s in samples_s)
        if samples_ms:
            fractions = [(i + 1) / len(samples_ms) for i in range(len(samples_ms))]
            axes.step(samples_ms, fractions, where="post", label=f"{label} (n={len(samples_ms)})")
    axes.set_xscale("log")
    axes.set_xlabel("latency (ms)")
    axes.set_ylabel("fraction of samples")
    axes.set_title("Latency CDF")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
