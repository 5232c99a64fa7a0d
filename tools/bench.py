"""Load generator for any OpenAI-compatible server (ours, vLLM, llama-server): runs a
seeded workload over streaming /v1/completions or /v1/chat/completions and reports TTFT,
TPOT, ITL and end-to-end percentiles, throughput, per-request JSON and a latency CDF plot.

Owns: the command line, statistics, the summary table, JSON and plot output.
Does not own: HTTP/SSE and timing (bench_client.py), workloads (bench_workloads.py).
Usage: python tools/bench.py --help; see docs/bench.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

# tools/ are scripts: their siblings import by module name (tools/ is on sys.path).
from bench_client import (DEFAULT_BASE_URL, ENDPOINT_PATHS, BenchError, ClientConfig,
                          Pacing, RequestRecord, RunResult, resolve_model, run_requests)
from bench_workloads import (LENGTH_DISTRIBUTIONS, WORKLOADS, BenchRequest, EstimateSizer,
                             PromptSizer, TokenizerSizer, WorkloadOptions, build_workload,
                             load_tokenizer_sizer, poisson_arrivals)

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                   ("E2E", "e2e_ms"))
EXIT_OK, EXIT_ALL_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
# Per-workload defaults: (num_requests, concurrency); None concurrency = no cap.
WORKLOAD_DEFAULTS: dict[str, tuple[int, int | None]] = {
    "batch": (64, 16), "shared-prefix": (64, 16), "single": (8, 1), "mixed": (64, 16),
    "long-burst": (24, None)}
EPILOG = """\
workload defaults (requests, concurrency):
  batch 64, 16          ~128-token prompts, 128 output tokens
  shared-prefix 64, 16  one ~512-token prefix + short unique questions, 64 output tokens
  single 8, 1           one stream at a time, ~128-token prompts, 128 output tokens
  mixed 64, 16          ~128-token prompts, output lengths in 16..256 (--length-dist:
                        uniform, or log-uniform: long-tailed, most outputs short)
  long-burst 24, none   8 streams decode 256 tokens from t=0 while bursts of 4
                        ~1500-token prompts arrive every 2 s (ITL reported per group)

examples:
  python tools/bench.py --workload mixed --ignore-eos --json out.json --plot cdf.png
  python tools/bench.py --base-url http://127.0.0.1:8080 --endpoint chat --request-rate 4
exit codes: 0 ok, 1 every request failed, 2 bad flags or unreachable server, 130 Ctrl-C
"""


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


# ---------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench.py", description=__doc__.split("\n\n")[0], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--base-url", default=DEFAULT_BASE_URL, help=f"server root URL ({DEFAULT_BASE_URL})")
    add("--endpoint", choices=tuple(ENDPOINT_PATHS), default="completions",
        help="/v1/completions (default) or /v1/chat/completions")
    add("--model", help="model name to send (default: the first of /v1/models)")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)")
    add("--workload", choices=WORKLOADS, default="batch", help="default: batch")
    add("--num-requests", type=int, help="requests to send (default: per workload)")
    add("--concurrency", type=int, help="max requests in flight (default: per workload)")
    add("--request-rate", type=float, help="Poisson arrivals, requests/s (seeded)")
    add("--max-tokens", type=int, help="output tokens (mixed: upper bound of 16..N)")
    add("--length-dist", choices=LENGTH_DISTRIBUTIONS, default="uniform",
        help="mixed: output lengths uniform (default) or log-uniform in 16..N")
    add("--prompt-tokens", type=int, help="prompt size (shared-prefix: the prefix)")
    add("--ignore-eos", action="store_true", help="send ignore_eos: exact output lengths")
    add("--temperature", type=float, default=0.0, help="sampling temperature (0)")
    add("--seed", type=int, default=0, help="seeds prompts, lengths, arrivals (0)")
    add("--tokenizer-gguf", help="size prompts exactly with this GGUF's tokenizer")
    add("--decode-streams", type=int, default=8, help="long-burst: decoding streams (8)")
    add("--burst-size", type=int, default=4, help="long-burst: prompts per burst (4)")
    add("--burst-interval-s", type=float, default=2.0,
        help="long-burst: seconds between bursts (2)")
    add("--timeout-s", type=float, default=600.0, help="per-request read timeout (600)")
    add("--json", metavar="FILE", help="write all figures and per-request records")
    add("--plot", metavar="FILE.png", help="write the TTFT/ITL/e2e latency CDF")
    add("--no-progress", action="store_true", help="hide the progress bar")
    return parser


@dataclass(frozen=True)
class RunPlan:
    """A validated run: what to send, how to pace it, where to report."""

    client: ClientConfig
    requests: list[BenchRequest]
    pacing: Pacing
    settings: dict[str, Any]
    """The command-line values, echoed into the JSON report."""


def plan_run(args: argparse.Namespace) -> RunPlan:
    """Validate flags (ValueError naming the bad one) and build the workload."""
    default_num, default_concurrency = WORKLOAD_DEFAULTS[args.workload]
    concurrency = args.concurrency
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if args.workload == "single":
        if concurrency not in (None, 1) or args.request_rate is not None:
            raise ValueError("--workload single sends one stream at a time: "
                             "drop --concurrency/--request-rate")
    elif args.workload == "long-burst" and args.request_rate is not None:
        raise ValueError("--workload long-burst sets its own arrival times: "
                         "drop --request-rate")
    if concurrency is None and args.request_rate is None:
        concurrency = default_concurrency
    num_requests = default_num if args.num_requests is None else args.num_requests
    options = WorkloadOptions(
        args.workload, num_requests, args.seed, args.max_tokens, args.prompt_tokens,
        args.decode_streams, args.burst_size, args.burst_interval_s,
        length_dist=args.length_dist)
    sizer: PromptSizer = EstimateSizer()
    counter: TokenizerSizer | None = None
    if args.tokenizer_gguf:
        sizer = counter = load_tokenizer_sizer(args.tokenizer_gguf)
    requests = build_workload(options, sizer)
    if args.request_rate is not None:
        offsets: list[float | None] = list(
            poisson_arrivals(len(requests), args.request_rate, args.seed))
    else:
        offsets = [r.arrival_s for r in requests]
    client = ClientConfig(args.base_url, args.endpoint, args.model, args.api_key,
                          args.ignore_eos, args.temperature, args.timeout_s, counter)
    settings = {k: v for k, v in vars(args).items() if k != "api_key"}
    settings.update(num_requests=len(requests), concurrency=concurrency)
    return RunPlan(client, requests, Pacing(offsets, concurrency), settings)


async def execute(plan: RunPlan, show_progress: bool) -> tuple[str | None, RunResult]:
    """Check the server, pick the model, then run the workload."""
    model = await resolve_model(plan.client)
    client = replace(plan.client, model=model)
    return model, await run_requests(client, plan.requests, plan.pacing, show_progress)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a benchmark; returns the exit code (0 ok, 1 all failed, 2 bad run, 130 Ctrl-C)."""
    args = build_parser().parse_args(argv)
    try:
        plan = plan_run(args)
        if args.plot:
            require_matplotlib()
        model, result = asyncio.run(execute(plan, show_progress=not args.no_progress))
    except (BenchError, ValueError) as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before the run started (or a second Ctrl-C)
        print("bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    report = bench_json({**plan.settings, "model": model}, result)
    title = f"{args.workload} / {args.endpoint}" + (" (interrupted)" if result.interrupted else "")
    print(format_summary(title, report["summary"], report["groups"]))
    print_errors(result.records)
    try:
        write_outputs(args.json, args.plot, report, result.records)
    except OSError as exc:
        print(f"bench: error: cannot write output: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if report["summary"]["num_ok"] else EXIT_ALL_FAILED


def write_outputs(json_path: str | None, plot_path: str | None, report: dict[str, Any],
                  records: Sequence[RequestRecord]) -> None:
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    if plot_path:
        plot_cdf(plot_path, records)


def print_errors(records: Sequence[RequestRecord], limit: int = 3) -> None:
    """The most common failure messages, so a broken run says why."""
    counts: dict[str, int] = {}
    for record in records:
        if record.error:
            counts[record.error] = counts.get(record.error, 0) + 1
    for message, count in sorted(counts.items(), key=lambda item: -item[1])[:limit]:
        print(f"failed x{count}: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
