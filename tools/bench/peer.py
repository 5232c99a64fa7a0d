"""Peer comparison: the same seeded streaming workloads against `justapi serve` and another
OpenAI-compatible server (llama-server), each workload on a fresh server, and the ratios of
their figures printed from one run (docs/bench.md has the llama-server build recipe).

  batch      64 requests, ~128-token prompts, 128 out, 16 at a time       output tok/s
  mixed      the same with outputs 16..256                                output tok/s
  prefix     64 requests sharing a ~510-token preamble, 64 out            output tok/s
  single     one stream, 256 tokens                                       output tok/s
  copy       repeat a ~300-token passage (chat), one at a time            output tok/s
  burst      8 streams decode 256 tokens; 8 prompts of ~1,500 tokens arrive at 3 s
                                             the streams' ITL p99 while the burst is prefilled
  multiturn  16 conversations x 4 turns (~512-token context, ~32-token questions, 64 out)
                                                                    TTFT p50 of turns 2-4

The peer is `--llama-server PATH` (started per workload: `-m GGUF -t N -np 16 -c 32768`
plus any --peer-arg) or `--peer-url URL` (one running server). `--base-tree DIR` adds a
third column: `justapi serve` run from another source tree (e.g. `git archive main | tar -x
-C DIR`), with the same serve args - the before of a before/after. Prompts are sized with the
GGUF's tokenizer; every request is greedy with ignore_eos. The load generator is
`justapi bench serve`'s (justapi/bench/), in this process. `--turns N` runs each workload N
times, fresh servers each turn, who goes first alternating, and prints every turn's ratio and
their median: on a shared host a server's figure can fall in two groups start to start
(docs/bench.md), and one run reads whichever group it got.

    python -m tools.bench peer --llama-server llama.cpp/build/bin/llama-server
    python -m tools.bench peer --llama-server PATH --workloads prefix --turns 5
    python -m tools.bench peer --peer-url http://127.0.0.1:8080 --workloads batch,single
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx

from justapi.bench.client import RequestRecord, RunResult
from justapi.bench.command import BenchOptions, execute, plan_run
from justapi.bench.conversations import LATER_GROUP
from justapi.bench.report import percentile, summarize, summarize_groups
from justapi.model.gguf_file import resolve_model_path
from tools.harness import ServedPool, ServeError, free_port

PROG = "python -m tools.bench peer"
BURST_AT_S = 3.0
COMMON = BenchOptions(ignore_eos=True, no_progress=True, seed=0)
Figure = Callable[[RunResult], float | None]


@dataclass(frozen=True)
class Workload:
    options: BenchOptions
    metric: str  # what the figure is
    figure: Figure
    higher_is_better: bool


def output_rate(result: RunResult) -> float:
    return summarize(result.records, result.duration_s)["output_throughput"]


def later_turns_ttft_s(result: RunResult) -> float | None:
    group = summarize_groups(result.records, result.duration_s).get(LATER_GROUP)
    p50 = group["ttft_ms"]["p50"] if group else None
    return None if p50 is None else p50 / 1000.0


def burst_itl_p99_s(result: RunResult) -> float | None:
    """p99 of the decode streams' gaps that overlap the burst: from the first burst request's
    start until the last one's first token (every burst prompt prefilled)."""
    bursts = [r for r in result.records if r.group == "burst" and r.ok and r.ttft_s is not None]
    if not bursts:
        return None
    start_s = min(r.start_s for r in bursts)
    end_s = max(r.start_s + r.ttft_s for r in bursts)  # type: ignore[operator]
    gaps = [gap for r in result.records if r.group == "decode" and r.ok
            for t, gap in stream_gaps(r) if t + gap > start_s and t < end_s]
    return percentile(gaps, 99) if gaps else None


def stream_gaps(record: RequestRecord) -> Iterator[tuple[float, float]]:
    """(time of the chunk before, gap) for each gap of a stream, times from the run's start."""
    t = record.start_s + (record.ttft_s or 0.0)
    for gap in record.itl_s:
        yield t, gap
        t += gap


def workloads() -> dict[str, Workload]:
    def bench(**fields: Any) -> BenchOptions:
        return replace(COMMON, **fields)

    rate, up = "output tok/s", True
    return {
        "batch": Workload(bench(workload="batch", num_requests=64, concurrency=16,
                                prompt_tokens=128, max_tokens=128), rate, output_rate, up),
        "mixed": Workload(bench(workload="mixed", num_requests=64, concurrency=16,
                                prompt_tokens=128, max_tokens=256), rate, output_rate, up),
        "prefix": Workload(bench(workload="shared-prefix", num_requests=64, concurrency=16,
                                 prompt_tokens=510, max_tokens=64), rate, output_rate, up),
        "single": Workload(bench(workload="single", num_requests=1, max_tokens=256), rate,
                           output_rate, up),
        "copy": Workload(bench(workload="copy", endpoint="chat", num_requests=2, concurrency=1,
                               prompt_tokens=300, max_tokens=300), rate, output_rate, up),
        "burst": Workload(bench(workload="long-burst", decode_streams=8, burst_size=8,
                                num_requests=16, burst_interval_s=2 * BURST_AT_S,
                                prompt_tokens=1500, max_tokens=256),
                          "streams' ITL p99 s in the burst", burst_itl_p99_s, False),
        "multiturn": Workload(bench(workload="multi-turn", num_requests=16, concurrency=16,
                                    turns=4, prompt_tokens=512, max_tokens=64),
                              "TTFT p50 s, turns 2-4", later_turns_ttft_s, False),
    }


# ---------------------------------------------------------------- servers
@dataclass(frozen=True)
class Server:
    """How to get a fresh server for one workload: a context manager yielding its URL."""

    name: str
    start: Callable[[], contextlib.AbstractContextManager[str]]


@contextlib.contextmanager
def justapi_server(serve_args: list[str], tree: str | None) -> Iterator[str]:
    """`justapi serve` (from `tree` when given: started in it, with its PYTHONPATH for the
    children; started here, `python -m` ran this tree's code whatever PYTHONPATH said)."""
    saved = os.environ.get("PYTHONPATH")
    if tree:
        os.environ["PYTHONPATH"] = os.path.abspath(tree)
    try:
        pool = ServedPool("--log-level", "warning", *serve_args,
                          cwd=os.path.abspath(tree) if tree else None)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    with pool:
        yield pool.base_url


@contextlib.contextmanager
def llama_server(binary: str, gguf: str, threads: int, extra: list[str]) -> Iterator[str]:
    """llama-server on a free loopback port, healthy once its model is loaded."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log")
    proc = subprocess.Popen([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(threads), "-np", "16", "-c", "32768", *extra],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log.name)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def wait_healthy(url: str, proc: subprocess.Popen, log_path: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServeError(f"llama-server exited with {proc.returncode}:\n{open(log_path).read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise ServeError(f"llama-server not healthy in {timeout_s:.0f}s:\n{open(log_path).read()}")


@contextlib.contextmanager
def running_server(url: str) -> Iterator[str]:
    yield url


def servers(args: argparse.Namespace) -> list[Server]:
    serve_args = ["--model", args.gguf, *args.serve_arg]
    out = [Server("justapi", lambda: justapi_server(serve_args, None))]
    if args.base_tree:
        out.append(Server("base", lambda: justapi_server(serve_args, args.base_tree)))
    if args.llama_server:
        out.append(Server("llama-server", lambda: llama_server(
            args.llama_server, args.gguf, args.threads, args.peer_arg)))
    elif args.peer_url:
        out.append(Server("peer", lambda: running_server(args.peer_url)))
    return out


# ---------------------------------------------------------------- the run
def measure(workload: Workload, url: str, gguf: str) -> dict[str, Any]:
    """Run the workload against url; its figure and the usual summary figures."""
    plan = plan_run(replace(workload.options, base_url=url, tokenizer_gguf=gguf))
    _, result = asyncio.run(execute(plan, show_progress=False))
    summary = summarize(result.records, result.duration_s)
    if summary["num_failed"]:
        raise SystemExit(f"{PROG}: {summary['num_failed']} requests failed against {url}: "
                         f"{next(r.error for r in result.records if r.error)}")
    return {
        "figure": workload.figure(result), "output_tok_s": summary["output_throughput"],
        "ttft_p50_s": (summary["ttft_ms"]["p50"] or 0) / 1000.0,
        "itl_p99_s": (summary["itl_ms"]["p99"] or 0) / 1000.0, "duration_s": result.duration_s}


def ratio(mine: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    """> 1 when `mine` is better."""
    if not mine or not theirs:
        return None
    return mine / theirs if higher_is_better else theirs / mine


def run_workload(workload: Workload, order: list[Server], gguf: str) -> dict[str, Any]:
    """The workload on a fresh server of each kind, in `order`."""
    figures: dict[str, dict[str, Any]] = {}
    for server in order:
        with server.start() as url:
            figures[server.name] = measure(workload, url, gguf)
    return figures


def turn_order(pool: list[Server], workload_index: int, turn: int) -> list[Server]:
    """Who goes first alternates from workload to workload and from turn to turn, so the host's
    drift lands on every server alike."""
    return pool if (workload_index + turn) % 2 == 0 else pool[::-1]


def ratios_of(figures: dict[str, dict[str, Any]], higher_is_better: bool) -> dict[str, float | None]:
    """justapi's figure against each other server's ("justapi/NAME"; > 1: justapi better)."""
    names = list(figures)
    return {f"justapi/{other}": ratio(figures["justapi"]["figure"], figures[other]["figure"], higher_is_better)
            for other in names[1:]}


def median_ratios(turns: list[dict[str, float | None]]) -> dict[str, tuple[float, float, float] | None]:
    """Per ratio, (median, lowest, highest) over the turns that have it (None: no turn has)."""
    out: dict[str, tuple[float, float, float] | None] = {}
    for key in turns[0]:
        values = [value for r in turns if (value := r.get(key)) is not None]
        out[key] = (statistics.median(values), min(values), max(values)) if values else None
    return out


def show(name: str, workload: Workload, turns: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Print one line of figures and one of ratios per turn; with several turns, the medians."""
    per_turn = []
    for index, figures in enumerate(turns):
        label = name if index == 0 else ""
        cells = "  ".join(f"{n} {fmt(f['figure'])}" for n, f in figures.items())
        print(f"{label:<10} {workload.metric:<34} {cells}")
        ratios = ratios_of(figures, workload.higher_is_better)
        per_turn.append(ratios)
        print(f"{'':<10} {'(> 1: justapi better)':<34} " + "  ".join(
            f"{k} {fmt(v)}x" for k, v in ratios.items()), flush=True)
    report: dict[str, Any] = {"metric": workload.metric, "figures": turns[0], "ratios": per_turn[0]}
    if len(turns) > 1:
        medians = median_ratios(per_turn)
        print(f"{'':<10} {f'median of {len(turns)} turns':<34} " + "  ".join(
            f"{k} {fmt(m[0])}x ({fmt(m[1])}-{fmt(m[2])})" if m else f"{k} -" for k, m in medians.items()),
            flush=True)
        report.update(turns=turns, turn_ratios=per_turn, median_ratios=medians)
    return report


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    chosen = workloads()
    names = args.workloads.split(",") if args.workloads else list(chosen)
    unknown = sorted(set(names) - set(chosen))
    if unknown:
        raise SystemExit(f"{PROG}: unknown workload(s) {unknown}; choose from {list(chosen)}")
    pool = servers(args)
    print(f"# load average {os.getloadavg()[0]:.2f}; servers: {', '.join(s.name for s in pool)}")
    report = {}
    for index, name in enumerate(names):
        turns = []
        for turn in range(args.turns):
            figures = run_workload(chosen[name], turn_order(pool, index, turn), args.gguf)
            turns.append({s.name: figures[s.name] for s in pool})
        report[name] = show(name, chosen[name], turns)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "workloads": report}, handle, indent=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="a flag for `justapi serve` (repeat: --serve-arg=--weights "
                             "--serve-arg=auto)")
    parser.add_argument("--base-tree", help="also run `justapi serve` from this source tree")
    parser.add_argument("--llama-server", help="llama-server binary to start per workload")
    parser.add_argument("--gguf", default="", help="the model for llama-server and the prompt "
                                                   "sizes (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server -t (default: the cores)")
    parser.add_argument("--peer-arg", action="append", default=[],
                        help="an extra llama-server flag (repeatable)")
    parser.add_argument("--peer-url", help="a running OpenAI-compatible server instead")
    parser.add_argument("--json", help="write every figure and ratio here")
    parser.add_argument("--turns", type=int, default=1,
                        help="run each workload this many times (fresh servers each turn) and print "
                             "the median ratio too")
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    args.gguf = resolve_model_path(args.gguf)
    return args


if __name__ == "__main__":
    main()
