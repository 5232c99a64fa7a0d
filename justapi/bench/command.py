"""`justapi bench serve`: load generator for any OpenAI-compatible server (ours, vLLM,
llama-server): runs a seeded workload over streaming /v1/completions or /v1/chat/completions
and reports TTFT, TPOT, ITL and end-to-end percentiles, throughput, per-request JSON and a
latency CDF plot.

Owns: the flags (one BenchOptions, each default written once there), planning a run, exit
codes and where output goes. Does not own: HTTP/SSE and timing (client.py), workloads
(workloads.py, conversations.py), statistics and formats (report.py). See docs/bench.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from dataclasses import dataclass, replace
from typing import Any

import click

from justapi.bench.client import (DEFAULT_BASE_URL, ENDPOINT_PATHS, BenchError, ClientConfig,
                                  Pacing, RunResult, resolve_model, run_requests)
from justapi.bench.conversations import Conversation, build_conversations, run_conversations
from justapi.bench.report import (bench_json, error_counts, format_summary, plot_cdf,
                                  require_matplotlib)
from justapi.bench.workloads import (LENGTH_DISTRIBUTIONS, WORKLOADS, BenchRequest,
                                     EstimateSizer, PromptSizer, TokenizerSizer,
                                     WorkloadOptions, build_workload, load_tokenizer_sizer,
                                     poisson_arrivals)

PROG = "justapi bench serve"
EXIT_OK, EXIT_ALL_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
# Per-workload defaults: (num_requests, concurrency); None concurrency = no cap.
WORKLOAD_DEFAULTS: dict[str, tuple[int, int | None]] = {
    "batch": (64, 16), "shared-prefix": (64, 16), "single": (8, 1), "mixed": (64, 16),
    "long-burst": (24, None), "copy": (2, 1), "multi-turn": (16, 16)}
EPILOG = """\b
workload defaults (requests, concurrency):
  batch 64, 16          ~128-token prompts, 128 output tokens
  shared-prefix 64, 16  one ~512-token prefix + short unique questions, 64 output tokens
  single 8, 1           one stream at a time, ~128-token prompts, 128 output tokens
  mixed 64, 16          ~128-token prompts, output lengths in 16..256 (--length-dist:
                        uniform, or log-uniform: long-tailed, most outputs short)
  long-burst 24, none   8 streams decode 256 tokens from t=0 while bursts of 4
                        ~1500-token prompts arrive every 2 s (ITL reported per group)
  copy 2, 1             repeat a ~300-token passage the prompt holds (300 output tokens)
  multi-turn 16, 16     16 conversations of --turns (4) turns: ~512-token context, then
                        each turn the transcript + a ~32-token question, 64 output
                        tokens (TTFT reported for turn 1 and turns 2+)

\b
examples:
  justapi bench serve --workload mixed --ignore-eos --json out.json --plot cdf.png
  justapi bench serve --base-url http://127.0.0.1:8080 --endpoint chat --request-rate 4
exit codes: 0 ok, 1 every request failed, 2 bad flags or unreachable server, 130 Ctrl-C
"""


@dataclass(frozen=True)
class BenchOptions:
    """The flags of `justapi bench serve`, one field each (the JSON report echoes them)."""

    base_url: str = DEFAULT_BASE_URL
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    workload: str = "batch"
    num_requests: int | None = None
    concurrency: int | None = None
    request_rate: float | None = None
    max_tokens: int | None = None
    length_dist: str = "uniform"
    prompt_tokens: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    tokenizer_gguf: str | None = None
    decode_streams: int = 8
    burst_size: int = 4
    burst_interval_s: float = 2.0
    turns: int = 4
    timeout_s: float = 600.0
    json: str | None = None
    plot: str | None = None
    no_progress: bool = False


@dataclass(frozen=True)
class RunPlan:
    """A validated run: what to send, how to pace it, where to report."""

    client: ClientConfig
    requests: list[BenchRequest]
    pacing: Pacing
    settings: dict[str, Any]
    """The flags' values, echoed into the JSON report."""
    conversations: list[Conversation] | None = None
    """multi-turn: what to run instead of `requests`."""


def plan_run(options: BenchOptions) -> RunPlan:
    """Validate flags (ValueError naming the bad one) and build the workload."""
    concurrency = _concurrency(options)
    default_num, _ = WORKLOAD_DEFAULTS[options.workload]
    num_requests = default_num if options.num_requests is None else options.num_requests
    workload = WorkloadOptions(
        options.workload, num_requests, options.seed, options.max_tokens, options.prompt_tokens,
        options.decode_streams, options.burst_size, options.burst_interval_s,
        length_dist=options.length_dist, turns=options.turns)
    sizer: PromptSizer = EstimateSizer()
    counter: TokenizerSizer | None = None
    if options.tokenizer_gguf:
        sizer = counter = load_tokenizer_sizer(options.tokenizer_gguf)
    conversations = None
    if options.workload == "multi-turn":
        conversations = build_conversations(workload, sizer)
        requests: list[BenchRequest] = []
    else:
        requests = build_workload(workload, sizer)
    if options.request_rate is not None:
        offsets: list[float | None] = list(
            poisson_arrivals(len(requests), options.request_rate, options.seed))
    else:
        offsets = [r.arrival_s for r in requests]
    client = ClientConfig(options.base_url, options.endpoint, options.model, options.api_key,
                          options.ignore_eos, options.temperature, options.timeout_s, counter)
    settings = {k: v for k, v in dataclasses.asdict(options).items() if k != "api_key"}
    settings.update(num_requests=len(conversations or requests), concurrency=concurrency)
    return RunPlan(client, requests, Pacing(offsets, concurrency), settings, conversations)


def _concurrency(options: BenchOptions) -> int | None:
    """The concurrency cap: the flag, else the workload's default unless --request-rate paces."""
    concurrency = options.concurrency
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if options.workload == "single":
        if concurrency not in (None, 1) or options.request_rate is not None:
            raise ValueError("--workload single sends one stream at a time: "
                             "drop --concurrency/--request-rate")
    elif options.workload in ("long-burst", "multi-turn") and options.request_rate is not None:
        raise ValueError(f"--workload {options.workload} sets its own arrival times: "
                         "drop --request-rate")
    if concurrency is None and options.request_rate is None:
        concurrency = WORKLOAD_DEFAULTS[options.workload][1]
    return concurrency


async def execute(plan: RunPlan, show_progress: bool) -> tuple[str | None, RunResult]:
    """Check the server, pick the model, then run the workload."""
    model = await resolve_model(plan.client)
    client = replace(plan.client, model=model)
    if plan.conversations is not None:
        return model, await run_conversations(client, plan.conversations,
                                              plan.pacing.concurrency, show_progress)
    return model, await run_requests(client, plan.requests, plan.pacing, show_progress)


def run(options: BenchOptions) -> int:
    """Run a benchmark; returns the exit code (0 ok, 1 all failed, 2 bad run, 130 Ctrl-C)."""
    try:
        plan = plan_run(options)
        if options.plot:
            require_matplotlib()
        model, result = asyncio.run(execute(plan, show_progress=not options.no_progress))
    except (BenchError, ValueError) as exc:
        click.echo(f"{PROG}: error: {exc}", err=True)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before the run started (or a second Ctrl-C)
        click.echo(f"{PROG}: interrupted", err=True)
        return EXIT_INTERRUPTED
    report = bench_json({**plan.settings, "model": model}, result)
    title = f"{options.workload} / {options.endpoint}" + (
        " (interrupted)" if result.interrupted else "")
    click.echo(format_summary(title, report["summary"], report["groups"]))
    for message, count in error_counts(result.records):
        click.echo(f"failed x{count}: {message}", err=True)
    try:
        write_outputs(options, report, result)
    except OSError as exc:
        click.echo(f"{PROG}: error: cannot write output: {exc}", err=True)
        return EXIT_USAGE
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if report["summary"]["num_ok"] else EXIT_ALL_FAILED


def write_outputs(options: BenchOptions, report: dict[str, Any], result: RunResult) -> None:
    if options.json:
        with open(options.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    if options.plot:
        plot_cdf(options.plot, result.records)


# ---------------------------------------------------------------- command line
DEFAULTS = BenchOptions()


@click.group("bench")
def bench() -> None:
    """Benchmark a running server (`justapi bench serve`)."""


@bench.command("serve", epilog=EPILOG)
@click.option("--base-url", default=DEFAULTS.base_url, show_default=True, help="Server root URL.")
@click.option("--endpoint", type=click.Choice(tuple(ENDPOINT_PATHS)), default=DEFAULTS.endpoint,
              show_default=True, help="/v1/completions or /v1/chat/completions.")
@click.option("--model", help="Model name to send (default: the first of /v1/models).")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Bearer token (default: $OPENAI_API_KEY).")
@click.option("--workload", type=click.Choice(WORKLOADS), default=DEFAULTS.workload,
              show_default=True)
@click.option("--num-requests", type=int,
              help="Requests to send (multi-turn: conversations; default: per workload).")
@click.option("--concurrency", type=int, help="Max requests in flight (default: per workload).")
@click.option("--request-rate", type=float, help="Poisson arrivals, requests/s (seeded).")
@click.option("--max-tokens", type=int, help="Output tokens (mixed: upper bound of 16..N).")
@click.option("--length-dist", type=click.Choice(LENGTH_DISTRIBUTIONS),
              default=DEFAULTS.length_dist, show_default=True,
              help="mixed: output lengths uniform or log-uniform in 16..N.")
@click.option("--prompt-tokens", type=int, help="Prompt size (shared-prefix: the prefix; copy: "
              "the passage; multi-turn: the first turn's context).")
@click.option("--ignore-eos", is_flag=True, help="Send ignore_eos: exact output lengths.")
@click.option("--temperature", type=float, default=DEFAULTS.temperature, show_default=True,
              help="Sampling temperature.")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True,
              help="Seeds prompts, lengths, arrivals.")
@click.option("--tokenizer-gguf", help="Size prompts exactly with this GGUF's tokenizer.")
@click.option("--decode-streams", type=int, default=DEFAULTS.decode_streams, show_default=True,
              help="long-burst: decoding streams.")
@click.option("--burst-size", type=int, default=DEFAULTS.burst_size, show_default=True,
              help="long-burst: prompts per burst.")
@click.option("--burst-interval-s", type=float, default=DEFAULTS.burst_interval_s,
              show_default=True, help="long-burst: seconds between bursts.")
@click.option("--turns", type=int, default=DEFAULTS.turns, show_default=True,
              help="multi-turn: turns per conversation.")
@click.option("--timeout-s", type=float, default=DEFAULTS.timeout_s, show_default=True,
              help="Per-request read timeout.")
@click.option("--json", metavar="FILE", help="Write all figures and per-request records.")
@click.option("--plot", metavar="FILE.png",
              help="Write the TTFT/ITL/e2e latency CDF (needs matplotlib: the bench extra).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def bench_serve(**flags: Any) -> None:
    """Load-test any OpenAI-compatible server with a seeded workload of streaming requests.

    Prints TTFT, TPOT, ITL and end-to-end percentiles and throughput; --json writes every
    figure and per-request record, --plot a latency CDF.
    """
    sys.exit(run(BenchOptions(**flags)))
