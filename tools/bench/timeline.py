"""Where a served step's time goes, and the serving path against the in-process engine.

For each batch size B (1, 4, 16): serve the model (`justapi serve`, the server's own defaults,
`--weights` as the server's default unless given) with JUSTAPI_TIMELINE set, run B streams at
a time (`justapi bench serve`, B x rounds requests of ~prompt-tokens, max-tokens out,
ignore_eos), stop it, read the three processes' timelines and print the median full-batch
decode step: worker busy (prepare, forward, sample, send) and idle (result to the scheduler,
the scheduler, plan to the worker), the frontend's part, and the same step in the in-process
engine (LLMEngine, the same weights, B sequences at a time). Served and offline runs take
turns (served, offline, then offline, served, ...) and the best of each is compared.

    python -m tools.bench timeline [--batches 1,4,16] [--turns 1] [--weights fp32]
    python -m tools.bench timeline --serve-arg=--no-overlap     # any extra server flag
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from justapi.config.sections import ModelConfig
from justapi.ops.timeline import TIMELINE_ENV, Event, load
from tools.bench.serve import run_bench
from tools.bench.timeline_analysis import Breakdown, offline_breakdown, served_breakdown
from tools.harness import ServedPool

PROG = "python -m tools.bench timeline"


@dataclass
class Run:
    tok_s: float
    step: Breakdown


def read_dir(directory: str) -> dict[str, list[Event]]:
    """role + index -> events of every dumped timeline in the directory."""
    out: dict[str, list[Event]] = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        role, index, events = load(path)
        out[f"{role}{index}"] = events
    return out


def served(args: argparse.Namespace, batch: int) -> Run:
    bench = ["--workload", "batch", "--ignore-eos", "--num-requests", str(batch * args.rounds),
             "--concurrency", str(batch), "--max-tokens", str(args.max_tokens),
             "--prompt-tokens", str(args.prompt_tokens)]
    with tempfile.TemporaryDirectory(prefix="justapi-timeline-") as directory:
        os.environ[TIMELINE_ENV] = directory
        try:
            with ServedPool("--log-level", "warning", "--model", args.model, "--weights",
                            args.weights, "--max-seqs", str(max(16, batch)), *args.serve_arg) as pool:
                summary = run_bench(pool.base_url, bench)["summary"]
        finally:
            del os.environ[TIMELINE_ENV]
        files = read_dir(directory)
    step = served_breakdown(files.get("worker0", []), files.get("scheduler0", []),
                            files.get("frontend0", []), batch)
    return Run(summary["output_throughput"], step)


OFFLINE = """
import sys, time
from justapi.ops.timeline import Timeline
from justapi.sampling import SamplingParams
from workers.engine import LLMEngine
model, weights, batch, num, prompt_tokens, max_tokens, directory = sys.argv[1:]
batch, num, prompt_tokens, max_tokens = int(batch), int(num), int(prompt_tokens), int(max_tokens)
engine = LLMEngine(model, max_seqs=batch, progress=False, weights=weights)
prompts = [[(17 * i + 7 * j) % 1000 + 100 for j in range(prompt_tokens)] for i in range(num)]
engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))
engine.runner.timeline = Timeline("offline", 0, directory)
t = time.perf_counter()
outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
print(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
engine.runner.timeline.dump()
"""


def offline(args: argparse.Namespace, batch: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="justapi-timeline-") as directory:
        done = subprocess.run(
            [sys.executable, "-c", OFFLINE, args.model, args.weights, str(batch),
             str(batch * args.rounds), str(args.prompt_tokens), str(args.max_tokens), directory],
            capture_output=True, text=True, check=True)
        events = read_dir(directory).get("offline0", [])
    return Run(float(done.stdout.strip().splitlines()[-1]), offline_breakdown(events, batch))


def report(batch: int, serves: list[Run], offlines: list[Run]) -> float:
    """Print one batch size's figures; return best served / best offline tok/s."""
    best_s = max(serves, key=lambda r: r.tok_s)
    best_o = max(offlines, key=lambda r: r.tok_s)
    ratio = best_s.tok_s / best_o.tok_s
    s, o = best_s.step, best_o.step
    print(f"\n## {batch} stream(s): served {best_s.tok_s:.1f} tok/s, offline {best_o.tok_s:.1f} "
          f"tok/s -> {ratio:.2f} (runs: served {' / '.join(f'{r.tok_s:.1f}' for r in serves)}; "
          f"offline {' / '.join(f'{r.tok_s:.1f}' for r in offlines)})")
    print(f"decode step, median ms ({s.num_steps} served / {o.num_steps} offline steps): "
          f"period {s.get('period'):.2f} served vs {o.get('period'):.2f} offline "
          f"({o.get('period') / s.get('period'):.2f})")
    print(f"  worker busy: prepare {s.get('prepare'):.2f} | forward {s.get('forward'):.2f} "
          f"(offline {o.get('forward'):.2f}) | sample {s.get('sample'):.2f} "
          f"(offline {o.get('sample'):.2f}) | send {s.get('send'):.2f}")
    print(f"  worker idle: {s.get('idle'):.2f} (plan already there in "
          f"{100 * s.plan_waiting:.0f}% of steps; otherwise: result -> scheduler "
          f"{s.get('to_scheduler'):.2f} | scheduler {s.get('scheduler'):.2f} | plan -> worker "
          f"{s.get('to_worker'):.2f})")
    print(f"  beside the next step: scheduler update + deltas {s.get('update'):.2f} | deltas -> "
          f"frontend {s.get('to_frontend'):.2f} | frontend deltas -> SSE {s.get('frontend'):.2f}")
    return ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--weights", default=ModelConfig().weights,
                        help="weight path of both the server and the offline engine "
                             "(default: the server's default)")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--turns", type=int, default=1, help="turns of (served, offline)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra flag for every server (repeat it)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(f"load average {os.getloadavg()[0]:.2f}; weights {args.weights}; server flags "
          f"{' '.join(args.serve_arg) or '(defaults)'}")
    ratios = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        serves: list[Run] = []
        offlines: list[Run] = []
        for turn in range(args.turns):
            for kind in (("served", "offline") if turn % 2 == 0 else ("offline", "served")):
                if kind == "served":
                    serves.append(served(args, batch))
                else:
                    offlines.append(offline(args, batch))
        ratios[batch] = report(batch, serves, offlines)
    print("\nserved / offline tok/s: " + ", ".join(f"batch {b}: {r:.2f}" for b, r in ratios.items())
          + f" (target >= 0.90); load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
