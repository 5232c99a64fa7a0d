#!/usr/bin/env python3
"""Replay a request trace through the real scheduler with a fake model and a step-cost model.

Capacity planning without a model: prints steps, batch occupancy, prefix-cache hit ratio,
preemptions, and queue time / TTFT / TPOT per request in steps and modelled seconds.

    python -m tools.simulate --generate 300 --rate 40 --prefix-groups 4 --prefix-len 256
    python -m tools.simulate --trace trace.jsonl --workers 2 --pool-blocks 2048 --compare-static

Trace lines (JSON): {"arrival_s": 0.1, "prompt_len": 300, "output_len": 64, "prefix_id": 2,
"prefix_len": 256, "priority": 0, "abort_after_s": null} (see justapi/scheduler/sim/trace.py).
Step time = a + b * tokens + c * context_reads (fit a, b, c from `justapi bench serve` runs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.sim.cost_model import StepCostModel
from justapi.scheduler.sim.report import format_requests, format_summary
from justapi.scheduler.sim.simulation import Simulation
from justapi.scheduler.sim.trace import TraceSpec, dump_trace, generate_trace, load_trace
from justapi.scheduler.topology import ModelLimits, Topology


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.simulate",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    _trace_args(p.add_argument_group("trace"))
    _scheduler_args(p.add_argument_group("scheduler (same names as justapi serve)"))
    cost = p.add_argument_group("step cost model")
    cost.add_argument("--cost-a", type=float, default=StepCostModel.a_s, help="s per step")
    cost.add_argument("--cost-b", type=float, default=StepCostModel.b_s, help="s per token")
    cost.add_argument("--cost-c", type=float, default=StepCostModel.c_s, help="s per context read")
    out = p.add_argument_group("output")
    out.add_argument("--per-request", type=int, default=10, metavar="N", help="rows to print")
    out.add_argument("--check-invariants", action="store_true", help="after every event (slow)")
    out.add_argument("--json", action="store_true", help="print summaries as JSON")
    args = p.parse_args(argv)
    if (args.trace is None) == (args.generate is None):
        p.error("give exactly one of --trace FILE or --generate N")
    return args


def _trace_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--trace", help="JSON-lines trace file ('-' for stdin)")
    group.add_argument("--generate", type=int, metavar="N", help="generate N requests instead")
    group.add_argument("--rate", type=float, default=0.0,
                       help="Poisson arrivals per s (0: all at t=0)")
    group.add_argument("--prompt-len", type=span, default=(32, 512), metavar="MIN:MAX")
    group.add_argument("--output-len", type=span, default=(16, 256), metavar="MIN:MAX")
    group.add_argument("--prefix-groups", type=int, default=0, help="shared-prefix groups")
    group.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    group.add_argument("--prefix-fraction", type=float, default=0.5)
    group.add_argument("--abort-fraction", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--save-trace", metavar="FILE", help="write the generated trace")


def _scheduler_args(group: argparse._ArgumentGroup) -> None:
    defaults = SchedulerConfig()
    for name in ("max_seqs", "max_prefill", "max_decode", "chunk_size", "max_batched_tokens"):
        group.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    group.add_argument("--policy", choices=("fcfs", "priority", "lpm"), default="fcfs")
    group.add_argument("--itl-target-ms", type=float, default=defaults.itl_target_ms,
                       help="stall-free step budget: -1 auto, 0 off (docs/scheduler.md)")
    group.add_argument("--no-scheduled", action="store_true", help="static batching")
    group.add_argument("--compare-static", action="store_true", help="also run static batching")
    group.add_argument("--pool-blocks", type=int, default=4096)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--workers", type=int, default=1)
    group.add_argument("--separate-pools", action="store_true", help="a pool per worker (GPUs)")
    group.add_argument("--max-context", type=int, default=8192)
    group.add_argument("--no-prefix-cache", action="store_true")


def load(args: argparse.Namespace) -> list:
    if args.generate is not None:
        trace = generate_trace(TraceSpec(
            num_requests=args.generate, rate_per_s=args.rate, prompt_len=args.prompt_len,
            output_len=args.output_len, num_prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len, prefix_fraction=args.prefix_fraction,
            abort_fraction=args.abort_fraction, seed=args.seed))
        if args.save_trace:
            with open(args.save_trace, "w") as handle:
                dump_trace(trace, handle)
        return trace
    if args.trace == "-":
        return load_trace(sys.stdin)
    with open(args.trace) as handle:
        return load_trace(handle)


def build(args: argparse.Namespace, scheduled: bool) -> Scheduler:
    config = SchedulerConfig(max_seqs=args.max_seqs, max_prefill=args.max_prefill,
                             max_decode=args.max_decode, chunk_size=args.chunk_size,
                             max_batched_tokens=args.max_batched_tokens, policy=args.policy,
                             scheduled=scheduled, itl_target_ms=args.itl_target_ms)
    topology = (Topology.pool_per_worker(args.pool_blocks, args.workers) if args.separate_pools
                else Topology.shared_pool(args.pool_blocks, args.workers))
    return Scheduler(config, CacheConfig(block_size=args.block_size,
                                         enable_prefix_cache=not args.no_prefix_cache),
                     topology, ModelLimits(args.max_context, ()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = load(args)
        runs = [not args.no_scheduled] + ([False] if args.compare_static else [])
        cost = StepCostModel(args.cost_a, args.cost_b, args.cost_c)
        summaries = {}
        for scheduled in runs:
            label = "continuous batching" if scheduled else "static batching (--no-scheduled)"
            sim = Simulation(build(args, scheduled), vocab_size=32000, cost=cost,
                             check_invariants=args.check_invariants)
            result = sim.run(trace)
            summaries[label] = result.summary(args.max_seqs, args.max_batched_tokens)
            if not args.json:
                print(format_summary(label, result, args.max_seqs, args.max_batched_tokens))
                if args.per_request:
                    print(format_requests(result, args.per_request))
                print()
    except (OSError, ValueError) as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
