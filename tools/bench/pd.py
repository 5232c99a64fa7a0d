"""PD disaggregation benchmark: `--pd 1:1` against two colocated workers (`--workers 2`) on
the same model and the same long-burst workload, printed side by side from one run.

For each configuration it starts `justapi serve` on a free port (tools/harness.py), waits for
/health, runs `justapi bench serve --workload long-burst --ignore-eos` (streams decoding while
bursts of long prompts arrive; docs/bench.md), reads its JSON and the server's /metrics, and
stops the server. The figure to compare is the p99 inter-token latency of the decode streams (how
much the long prefills stall them); total tokens/s says what the disaggregation costs.
Targets (docs/pd.md): PD p99 ITL <= 0.5 x colocated, PD total tokens/s >= 0.8 x colocated.

    python -m tools.bench pd                      # the default SmolLM2 model, defaults
    python -m tools.bench pd --pd 1:1 --pd-separate-pools --json pd.json
    python -m tools.bench pd --model synthetic:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128

Owns: the two runs and the comparison. Does not own: the load generator (justapi/bench/).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from typing import Any

from tools.harness import ServedPool

PROG = "python -m tools.bench pd"
ITL_TARGET = 0.5  # PD decode-stream p99 ITL at most this fraction of colocated
THROUGHPUT_TARGET = 0.8  # PD total tokens/s at least this fraction of colocated
PD_METRICS = ("justapi:pd_handoffs_total", "justapi:pd_handoff_blocks_total",
              "justapi:pd_handoff_bytes_total", "justapi:pd_copied_bytes_total",
              "justapi:pd_handoff_latency_seconds_sum", "justapi:pd_handoff_latency_seconds_count")


def run_config(name: str, serve_args: list[str], bench_args: list[str]) -> dict[str, Any]:
    """Serve, load with `justapi bench serve`, collect its JSON report and the PD metrics, stop."""
    print(f"{PROG}: {name}: justapi serve {' '.join(serve_args)}", file=sys.stderr, flush=True)
    with ServedPool("--log-level", "warning", *serve_args) as server:
        with tempfile.NamedTemporaryFile(suffix=".json") as report:
            command = [sys.executable, "-m", "justapi.cli", "bench", "serve", "--base-url",
                       server.base_url, "--workload", "long-burst", "--ignore-eos",
                       "--no-progress", "--json", report.name, *bench_args]
            done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{PROG}: justapi bench serve failed for {name}:\n{done.stderr}")
            result = json.load(open(report.name))
        result["pd_metrics"] = server.settled_metrics(PD_METRICS)
        return result


def figures(result: dict[str, Any]) -> dict[str, float | None]:
    summary, groups = result["summary"], result["groups"]
    decode, burst = groups.get("decode", summary), groups.get("burst", summary)
    pd = result.get("pd_metrics", {})
    handoffs = pd.get("justapi:pd_handoff_latency_seconds_count", 0.0)
    return {
        "decode ITL p50 (ms)": decode["itl_ms"]["p50"],
        "decode ITL p90 (ms)": decode["itl_ms"]["p90"],
        "decode ITL p99 (ms)": decode["itl_ms"]["p99"],
        "decode TPOT mean (ms)": decode["tpot_ms"]["mean"],
        "burst TTFT p50 (ms)": burst["ttft_ms"]["p50"],
        "burst TTFT p99 (ms)": burst["ttft_ms"]["p99"],
        "duration (s)": summary["duration_s"],
        "output tokens/s": summary["output_throughput"],
        "total tokens/s": summary["total_token_throughput"],
        "KV hand-offs": pd.get("justapi:pd_handoffs_total"),
        "KV blocks handed off": pd.get("justapi:pd_handoff_blocks_total"),
        "KV MiB handed off": (pd["justapi:pd_handoff_bytes_total"] / 2**20
                              if "justapi:pd_handoff_bytes_total" in pd else None),
        "KV MiB copied": (pd["justapi:pd_copied_bytes_total"] / 2**20
                          if "justapi:pd_copied_bytes_total" in pd else None),
        "hand-off latency mean (ms)": (pd["justapi:pd_handoff_latency_seconds_sum"] / handoffs
                                       * 1000.0 if handoffs else None),
    }


def report(results: dict[str, dict[str, Any]], names: tuple[str, str]) -> str:
    base, pd = (figures(results[n]) for n in names)
    lines = [f"{'':<28}{names[0]:>20}{names[1]:>20}{'ratio':>10}"]
    counts = [f"{results[n]['summary']['num_ok']} / {results[n]['summary']['num_failed']}"
              for n in names]
    lines.append(f"{'requests ok / failed':<28}{counts[0]:>20}{counts[1]:>20}")
    for key in base:
        a, b = base[key], pd[key]
        ratio = f"{b / a:.2f}" if a and b is not None else ""
        lines.append(f"{key:<28}{_cell(a):>20}{_cell(b):>20}{ratio:>10}")
    lines += verdict(base, pd)
    return "\n".join(lines)


def verdict(base: dict[str, float | None], pd: dict[str, float | None]) -> list[str]:
    itl_a, itl_b = base["decode ITL p99 (ms)"], pd["decode ITL p99 (ms)"]
    tput_a, tput_b = base["total tokens/s"], pd["total tokens/s"]
    if not (itl_a and itl_b and tput_a and tput_b):
        return ["targets: not enough samples to judge"]
    itl_ok, tput_ok = itl_b <= ITL_TARGET * itl_a, tput_b >= THROUGHPUT_TARGET * tput_a
    return [f"target p99 ITL <= {ITL_TARGET:.1f}x colocated: {itl_b / itl_a:.2f}x "
            f"({'met' if itl_ok else 'NOT met'})",
            f"target total tokens/s >= {THROUGHPUT_TARGET:.1f}x colocated: {tput_b / tput_a:.2f}x "
            f"({'met' if tput_ok else 'NOT met'})"]


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="", help="GGUF file or synthetic: spec (default: SmolLM2)")
    add("--pd", default="1:1", help="PD layout to compare (1:1)")
    add("--pd-separate-pools", action="store_true", help="PD with a KV segment per side (copy)")
    add("--workers", type=int, default=2, help="colocated workers to compare with (2)")
    add("--serve-arg", action="append", default=[], metavar="ARG",
        help="extra `justapi serve` argument for both (repeat: --serve-arg=--max-seqs=16)")
    add("--num-requests", type=int, default=24, help="bench serve --num-requests (24)")
    add("--decode-streams", type=int, default=8, help="bench serve --decode-streams (8)")
    add("--burst-size", type=int, default=4, help="bench serve --burst-size (4)")
    add("--burst-interval-s", type=float, default=2.0, help="bench serve --burst-interval-s (2)")
    add("--max-tokens", type=int, default=256, help="decode streams' output tokens (256)")
    add("--prompt-tokens", type=int, default=1500, help="burst prompt tokens (1500)")
    add("--seed", type=int, default=0, help="workload seed (0)")
    add("--json", metavar="FILE", help="write both runs' `justapi bench serve` reports")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    common = [*(["--model", args.model] if args.model else []), *args.serve_arg]
    bench_args = ["--num-requests", str(args.num_requests), "--decode-streams",
                  str(args.decode_streams), "--burst-size", str(args.burst_size),
                  "--burst-interval-s", str(args.burst_interval_s), "--max-tokens",
                  str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
                  "--seed", str(args.seed)]
    pd_args = ["--pd", args.pd, *(["--pd-separate-pools"] if args.pd_separate_pools else [])]
    names = (f"--workers {args.workers}", f"--pd {args.pd}" + (" sep" if args.pd_separate_pools
                                                                else ""))
    results = {names[0]: run_config(names[0], [*common, "--workers", str(args.workers)],
                                    bench_args),
               names[1]: run_config(names[1], [*common, *pd_args], bench_args)}
    print(f"long-burst: {args.decode_streams} streams x {args.max_tokens} tokens, bursts of "
          f"{args.burst_size} x ~{args.prompt_tokens}-token prompts every "
          f"{args.burst_interval_s:g} s, {args.num_requests} requests")
    print(report(results, names))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
