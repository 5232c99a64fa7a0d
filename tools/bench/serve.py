"""Serving benchmarks that compare configurations of `justapi serve` side by side, one run each.

Each comparison starts the real process pool per configuration (tools/harness.py), drives
it with `justapi bench serve` (streaming OpenAI requests), stops it, and prints the figures
with their ratio. The machine is noisy: compare ratios from one run, not absolute figures
across runs.

  scheduled-vs-static  mixed output lengths 16..256 (--length-dist uniform or log-uniform):
                       continuous vs static batching
  prefix-cache         shared ~512-token prefix: with vs without the prefix cache
  overhead             64 requests at concurrency 16: HTTP serving (one worker, and on CPU also
                       one single-thread worker per core) vs the in-process engine
  control-plane        tiny synthetic model, 64 concurrent streams: tokens/s through HTTP

    python -m tools.bench serve all
    python -m tools.bench serve prefix-cache --num-requests 32
    python -m tools.bench serve all --serve-arg=--gpu    # every server with --gpu (and the
                                                         # offline engine on cuda)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from tools.harness import ServedPool

PROG = "python -m tools.bench serve"
TINY = "synthetic:layers=1,hidden=64,heads=4,kv_heads=2,ffn=128,context=2048"


def run_bench(url: str, bench_args: list[str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run([sys.executable, "-m", "justapi.cli", "bench", "serve",
                               "--base-url", url, "--json", out.name, "--no-progress",
                               *bench_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{PROG}: justapi bench serve {' '.join(bench_args)} failed:\n"
                             f"{done.stderr}")
        return json.load(open(out.name))


EXTRA_SERVE_ARGS: list[str] = []
"""--serve-arg values: appended to every server's flags."""


STEP_METRICS = ("justapi:worker_steps_total", "justapi:generation_tokens_total")


def serve_and_bench(serve_args: list[str], bench_args: list[str],
                    count_steps: bool = False) -> dict[str, Any]:
    """`justapi bench serve`'s summary; with `count_steps` also the server's steps and
    generated tokens per step (read from /metrics once its figures settle)."""
    with ServedPool("--log-level", "warning", *serve_args, *EXTRA_SERVE_ARGS) as server:
        summary = run_bench(server.base_url, bench_args)["summary"]
        if not count_steps:
            return summary
        metrics = server.settled_metrics(STEP_METRICS)
    steps, tokens = metrics["justapi:worker_steps_total"], metrics["justapi:generation_tokens_total"]
    return {**summary, "steps": steps, "tokens_per_step": tokens / max(1.0, steps)}


def show(title: str, rows: list[tuple[str, dict[str, Any]]], ratio_of: str, target: str) -> None:
    print(f"\n## {title}")
    print(f"{'configuration':<28} {'output tok/s':>13} {'req/s':>8} {'TTFT p50 s':>11} "
          f"{'ITL p50 ms':>11} {'e2e p50 s':>10}")
    for name, s in rows:
        print(f"{name:<28} {s['output_throughput']:>13.1f} {s['request_throughput']:>8.2f} "
              f"{s['ttft_ms']['p50'] / 1e3:>11.3f} {s['itl_ms']['p50']:>11.1f} "
              f"{s['e2e_ms']['p50'] / 1e3:>10.2f}")
    a, b = rows[0][1], rows[1][1]
    print(f"ratio ({ratio_of}): {a['output_throughput'] / b['output_throughput']:.2f}x "
          f"output tokens/s; e2e p50 {b['e2e_ms']['p50'] / a['e2e_ms']['p50']:.2f}x faster "
          f"(target: {target})")


def scheduled_vs_static(args: argparse.Namespace) -> None:
    bench = ["--workload", "mixed", "--ignore-eos", "--num-requests", str(args.num_requests),
             "--concurrency", "32", "--max-tokens", "256", "--length-dist", args.length_dist]
    common = ["--model", args.model, "--max-seqs", "16"]
    configs = [("continuous (--scheduled)", common), ("static (--no-scheduled)",
                                                      [*common, "--no-scheduled"])]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    for turn in range(args.turns):  # AB, then BA: the host's drift lands on both
        for name, flags in configs if turn % 2 == 0 else configs[::-1]:
            runs[name].append(serve_and_bench(flags, bench, count_steps=True))
    rows = [(name, max(summaries, key=lambda s: s["output_throughput"]))
            for name, summaries in runs.items()]
    title = f"continuous vs static batching, outputs {args.length_dist} in 16..256"
    if args.turns > 1:
        title += f", best of {args.turns} turns (runs: " + "; ".join(
            f"{name.split()[0]} " + " / ".join(f"{s['output_throughput']:.1f}" for s in summaries)
            for name, summaries in runs.items()) + " tok/s)"
    show(title, rows, "continuous / static", ">= 2x")
    # Tokens per step is what a device whose step cost is flat in the batch size (a GPU at
    # 16 rows) turns into throughput; a CPU's step cost grows with the rows, so a draining
    # static batch gets cheaper steps and the throughput ratio stays below this one.
    (_, continuous), (_, static) = rows
    print(f"tokens per step: continuous {continuous['tokens_per_step']:.2f} "
          f"({continuous['steps']:.0f} steps), static {static['tokens_per_step']:.2f} "
          f"({static['steps']:.0f} steps): {continuous['tokens_per_step'] / static['tokens_per_step']:.2f}x")


def prefix_cache(args: argparse.Namespace) -> None:
    bench = ["--workload", "shared-prefix", "--ignore-eos", "--num-requests",
             str(args.num_requests), "--max-tokens", "16"]
    common = ["--model", args.model]
    rows = [("with prefix cache", serve_and_bench(common, bench)),
            ("--no-prefix-cache", serve_and_bench([*common, "--no-prefix-cache"], bench))]
    show("shared ~512-token prefix + short questions", rows, "cache / no cache", ">= 3x")


def overhead(args: argparse.Namespace) -> None:
    """In turns: one worker with every core's thread, one single-thread worker per core (CPU
    only; they share one KV pool), and the offline engine (one process, every core's thread)."""
    num, prompt_tokens, max_tokens = args.num_requests, 128, 128
    bench = ["--workload", "batch", "--ignore-eos", "--num-requests", str(num),
             "--concurrency", "16", "--max-tokens", str(max_tokens), "--prompt-tokens",
             str(prompt_tokens)]
    cores = os.cpu_count() or 1
    layouts: list[tuple[str, list[str]]] = [("--workers 1", [])]
    if "--gpu" not in EXTRA_SERVE_ARGS and cores > 1:
        layouts.append((f"--workers {cores}", ["--workers", str(cores)]))
    served: dict[str, list[float]] = {name: [] for name, _ in layouts}
    offline: list[float] = []
    order: list[tuple[str, list[str]]] = [*layouts, ("offline", [])]
    for turn in range(args.repeats):  # in turns: the host's load swings, so best against best;
        for name, flags in order if turn % 2 == 0 else order[::-1]:  # ABC, then CBA: none always last
            if name == "offline":
                offline.append(offline_engine(args.model, num, prompt_tokens, max_tokens, max_seqs=16))
                continue
            summary = serve_and_bench(["--model", args.model, "--max-seqs", "16", *flags], bench)
            served[name].append(summary["output_throughput"])
    print(f"\n## serving path vs in-process engine, {num} x (~{prompt_tokens} prompt + "
          f"{max_tokens} output), 16 at a time, {args.repeats} turn(s) each")
    print(f"{'in-process engine (offline)':<34} {max(offline):8.1f} output tok/s (runs: "
          f"{', '.join(f'{x:.1f}' for x in offline)})")
    for name, runs in served.items():
        print(f"{'justapi serve ' + name:<34} {max(runs):8.1f} output tok/s (runs: "
              f"{', '.join(f'{x:.1f}' for x in runs)}); best / best offline "
              f"{max(runs) / max(offline):.2f} (target: >= 0.90)")


def offline_engine(model: str, num: int, prompt_tokens: int, max_tokens: int, max_seqs: int) -> float:
    """Output tokens/s of workers.engine.LLMEngine on the same shape of work."""
    device = "cuda" if "--gpu" in EXTRA_SERVE_ARGS else "cpu"
    code = f"""
import time
from justapi.sampling import SamplingParams
from workers.engine import LLMEngine
engine = LLMEngine({model!r}, max_seqs={max_seqs}, progress=False, device={device!r})
prompts = [[(17 * i + 7 * j) % 1000 + 100 for j in range({prompt_tokens})] for i in range({num})]
engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))
t = time.perf_counter()
outs = engine.generate(prompts, SamplingParams(max_tokens={max_tokens}, temperature=0, ignore_eos=True))
print(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    return float(result.stdout.strip().splitlines()[-1])


def control_plane(args: argparse.Namespace) -> None:
    bench = ["--workload", "batch", "--ignore-eos", "--num-requests", "256", "--concurrency",
             "64", "--max-tokens", "512", "--prompt-tokens", "16"]
    summary = serve_and_bench(["--model", TINY, "--max-seqs", "64", "--max-decode", "64",
                               "--pool-blocks", "4096"], bench)
    print("\n## control plane: tiny synthetic model, 64 concurrent streams, 512 tokens each")
    print(f"output tokens/s through HTTP: {summary['output_throughput']:.0f} (target: >= 10,000)"
          f"; ITL p50 {summary['itl_ms']['p50']:.1f} ms, p99 {summary['itl_ms']['p99']:.1f} ms")


COMPARISONS = {"scheduled-vs-static": scheduled_vs_static, "prefix-cache": prefix_cache,
               "overhead": overhead, "control-plane": control_plane}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=[*COMPARISONS, "all"])
    parser.add_argument("--model", default="", help="GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--length-dist", choices=("uniform", "log-uniform"), default="uniform",
                        help="scheduled-vs-static: how output lengths spread over 16..256")
    parser.add_argument("--turns", type=int, default=1,
                        help="scheduled-vs-static: turns of (continuous, static), alternating "
                             "which goes first; the best of each compared")
    parser.add_argument("--repeats", type=int, default=2,
                        help="overhead: turns of (serve, offline), best of each compared")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra flag for every server (repeat it: --serve-arg=--gpu)")
    args = parser.parse_args(argv)
    EXTRA_SERVE_ARGS[:] = args.serve_arg
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for name, fn in COMPARISONS.items():
        if args.which in (name, "all"):
            fn(args)


if __name__ == "__main__":
    main()
