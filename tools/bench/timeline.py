"""Where a served step's time goes, and the serving path against the in-process engine.

For each batch size B (1, 4, 16): serve the model (`justapi serve`, the server's own defaults,
`--weights` as the server's default unless given) with JUSTAPI_TIMELINE set, run B streams at
a time (`justapi bench serve`, B x rounds requests of prompt-tokens in the model's own
tokens, as the offline prompts are, max-tokens out, ignore_eos), stop it, read the three
processes' timelines and print the median full-batch decode step: worker busy (prepare,
forward, sample, send) and idle (result to the scheduler, the scheduler, plan to the worker),
the frontend's part, and the same step in the in-process engine (LLMEngine, the same weights,
B sequences at a time). Served and offline runs take turns (served, offline, then offline,
served, ...) and the best of each is compared;
`--versus FLAG` adds a second served configuration to the turns (overlap on and off).

    python -m tools.bench timeline [--batches 1,4,16] [--turns 1] [--weights fp32]
    python -m tools.bench timeline --versus=--no-overlap --turns 2
    python -m tools.bench timeline --serve-arg=--cpu-spin=0     # any extra server flag
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
from justapi.model.gguf_file import resolve_model_path
from justapi.ops.timeline import TIMELINE_ENV, Event, load
from tools.bench.serve import run_bench
from tools.bench.timeline_analysis import Breakdown, offline_breakdown, served_breakdown
from tools.harness import ServedPool

PROG = "python -m tools.bench timeline"


@dataclass
class Run:
    tok_s: float
    step: Breakdown  # its median full-batch decode step


def read_dir(directory: str) -> dict[str, list[Event]]:
    """role + index -> events of every dumped timeline in the directory."""
    out: dict[str, list[Event]] = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        role, index, events = load(path)
        out[f"{role}{index}"] = events
    return out


def served(args: argparse.Namespace, batch: int, flags: list[str]) -> Run:
    bench = ["--workload", "batch", "--ignore-eos", "--num-requests", str(batch * args.rounds),
             "--concurrency", str(batch), "--max-tokens", str(args.max_tokens),
             "--prompt-tokens", str(args.prompt_tokens), "--tokenizer-gguf", resolve_model_path(args.model)]
    with tempfile.TemporaryDirectory(prefix="justapi-timeline-") as directory:
        os.environ[TIMELINE_ENV] = directory
        try:
            with ServedPool("--log-level", "warning", "--model", args.model, "--weights",
                            args.weights, "--max-seqs", str(max(16, batch)),
                            "--ready-timeout-s", "900", *flags) as pool:
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
ids = min(1000, engine.model.params.vocab_size - 100)  # a tiny vocabulary (the ~1B shape's 384) too
prompts = [[(17 * i + 7 * j) % ids + 100 for j in range(prompt_tokens)] for i in range(num)]
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


def report_served(name: str, runs: list[Run], offline: Run) -> float:
    """Print one served configuration's figures against the best offline run; return best
    served / best offline tok/s."""
    best = max(runs, key=lambda r: r.tok_s)
    ratio = best.tok_s / offline.tok_s
    s, o = best.step, offline.step
    print(f"{name}: {best.tok_s:.1f} tok/s -> {ratio:.2f} of offline (runs "
          f"{' / '.join(f'{r.tok_s:.1f}' for r in runs)}); decode step period "
          f"{s.get('period'):.2f} ms over {s.num_steps} plans of {s.steps_per_plan:g} step(s) "
          f"({o.get('period') / s.get('period'):.2f} of offline's)")
    print(f"  worker busy: prepare {s.get('prepare'):.2f} | forward {s.get('forward'):.2f} "
          f"(offline {o.get('forward'):.2f}) | sample {s.get('sample'):.2f} "
          f"(offline {o.get('sample'):.2f}) | send {s.get('send'):.2f}")
    print(f"  worker idle: {s.get('idle'):.2f} (plan already there in "
          f"{100 * s.plan_waiting:.0f}% of steps; otherwise: result -> scheduler "
          f"{s.get('to_scheduler'):.2f} | scheduler {s.get('scheduler'):.2f} | plan -> worker "
          f"{s.get('to_worker'):.2f})")
    print(f"  beside the next step: scheduler update + deltas {s.get('update'):.2f} | deltas -> "
          f"frontend {s.get('to_frontend'):.2f} | frontend deltas -> SSE {s.get('frontend'):.2f}")
    print(f"  CPU ms per step: worker {s.get('cpu_worker'):.2f} | scheduler "
          f"{s.get('cpu_scheduler'):.2f} | frontend {s.get('cpu_frontend'):.2f}")
    return ratio


def run_batch(args: argparse.Namespace, batch: int, configs: dict[str, list[str]]) -> dict[str, float]:
    """Every configuration and the offline engine in turns (the order reversed each turn);
    prints the figures and returns each configuration's served / offline ratio."""
    runs: dict[str, list[Run]] = {name: [] for name in [*configs, "offline"]}
    for turn in range(args.turns):
        for name in (list(runs) if turn % 2 == 0 else list(runs)[::-1]):
            runs[name].append(offline(args, batch) if name == "offline"
                              else served(args, batch, configs[name]))
    best = max(runs["offline"], key=lambda r: r.tok_s)
    print(f"\n## {batch} stream(s): offline {best.tok_s:.1f} tok/s (runs "
          f"{' / '.join(f'{r.tok_s:.1f}' for r in runs['offline'])}); decode step period "
          f"{best.step.get('period'):.2f} ms, forward {best.step.get('forward'):.2f}, sample "
          f"{best.step.get('sample'):.2f} ({best.step.num_steps} steps)")
    return {name: report_served(name, runs[name], best) for name in configs}


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
    parser.add_argument("--turns", type=int, default=1, help="turns of (served..., offline)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra flag for every server (repeat it)")
    parser.add_argument("--versus", default="",
                        help="also serve with this flag added, in the same turns (e.g. "
                             "--versus=--no-overlap): the pair's figures side by side")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(f"load average {os.getloadavg()[0]:.2f}; weights {args.weights}; server flags "
          f"{' '.join(args.serve_arg) or '(defaults)'}")
    configs = {"served": list(args.serve_arg)}
    if args.versus:
        configs[f"served {args.versus}"] = [*args.serve_arg, args.versus]
    ratios = {batch: run_batch(args, batch, configs)
              for batch in [int(b) for b in args.batches.split(",")]}
    for name in configs:
        print(f"\n{name} / offline tok/s: " + ", ".join(
            f"batch {b}: {r[name]:.2f}" for b, r in ratios.items()) + " (target >= 0.90)")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
