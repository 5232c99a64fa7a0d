#!/usr/bin/env python3
"""Benchmark the scheduler core (pure Python, no model): cost of schedule() + update() per
step with many running and waiting requests, and of radix `match` against prompt length and
tree size. Prints figures; docs/scheduler.md records them with this command.

    python tools/bench_scheduler.py [--running 256] [--waiting 10000] [--steps 300]
"""
from __future__ import annotations

import argparse
import array
import random
import statistics
import time

import numpy as np

from justapi.config import CacheConfig, SchedulerConfig
from justapi.protocol import StepPlan, StepResult, SubmitRequest
from justapi.sampling import SamplingParams
from justapi.scheduler.block_pool import BlockPool
from justapi.scheduler.radix_cache import RadixPrefixCache
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.topology import ModelLimits, PoolSpec, Topology

VOCAB = 32000


def fake_result(worker_id: int, plan: StepPlan, rng: random.Random) -> StepResult:
    """What a worker would answer: one token per sampled sequence (never EOS)."""
    ids = [rid for rid, flag in zip(plan.request_ids, plan.sample_flags) if flag]
    return StepResult(step_id=plan.step_id, worker_id=worker_id, request_ids=ids,
                      num_sampled=np.ones(len(ids), dtype=np.int32),
                      sampled_token_ids=np.asarray([rng.randrange(2, VOCAB) for _ in ids],
                                                   dtype=np.int32))


def bench_step(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    config = SchedulerConfig(max_seqs=args.running, max_decode=args.running, max_prefill=4,
                             chunk_size=512, max_batched_tokens=args.running + 2048)
    blocks_per_req = -(-(args.prompt_len + 400) // args.block_size)
    pool_blocks = args.running * blocks_per_req * 2
    sched = Scheduler(config, CacheConfig(block_size=args.block_size),
                      Topology.shared_pool(pool_blocks, 1), ModelLimits(8192, (0,)))
    for i in range(args.running + args.waiting):
        prompt = np.asarray([rng.randrange(2, VOCAB) for _ in range(args.prompt_len)], np.int32)
        sched.add_request(SubmitRequest(f"r{i}", prompt,
                                        SamplingParams(max_tokens=rng.randint(50, 400))))
    while sched.stats()["num_requests_running"] < args.running:  # warm up: admit and prefill
        for worker_id, plan in sched.schedule():
            sched.update(fake_result(worker_id, plan, rng))
    sched_s, update_s, seqs = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plans = sched.schedule()
        t1 = time.perf_counter()
        results = [fake_result(w, p, rng) for w, p in plans]
        t2 = time.perf_counter()
        for result in results:
            sched.update(result)
        t3 = time.perf_counter()
        sched_s.append(t1 - t0)
        update_s.append(t3 - t2)
        seqs.append(sum(p.num_seqs for _, p in plans))
    total = [a + b for a, b in zip(sched_s, update_s)]
    stats = sched.stats()
    print(f"step cost, {args.running} running / {args.waiting} waiting "
          f"(prompt {args.prompt_len} tokens, block {args.block_size}), {args.steps} steps:")
    print(f"  sequences per step: mean {statistics.mean(seqs):.1f}; "
          f"still waiting {int(stats['num_requests_waiting'])}")
    for name, values in (("schedule", sched_s), ("update", update_s), ("schedule+update", total)):
        ms = sorted(v * 1e3 for v in values)
        print(f"  {name:16s} median {statistics.median(ms):.3f} ms   p90 "
              f"{ms[int(0.9 * len(ms))]:.3f} ms   max {ms[-1]:.3f} ms")


def _prompt(rng: random.Random, num_blocks: int, block_size: int) -> array.array:
    return array.array("i", (rng.randrange(2, VOCAB) for _ in range(num_blocks * block_size)))


def _fill_tree(cache: RadixPrefixCache, pool: BlockPool, rng: random.Random, num_prompts: int,
               num_blocks: int, block_size: int) -> None:
    for i in range(num_prompts):
        tokens = _prompt(rng, num_blocks, block_size)
        ids = pool.allocate(0, num_blocks, f"f{i}")
        cache.insert(tokens.tobytes(), ids, "", f"f{i}")


def _time_match(cache: RadixPrefixCache, tokens: bytes, num_blocks: int, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        cache.match_length(tokens, "", num_blocks)
    return (time.perf_counter() - start) / repeat


def bench_match(args: argparse.Namespace) -> None:
    rng = random.Random(1)
    bs = args.block_size
    print(f"radix match cost vs prompt length (tree: 2000 prompts of 64 blocks, block {bs}):")
    pool = BlockPool([PoolSpec(0, 2000 * 64 + 4096)])
    cache = RadixPrefixCache(pool, 0, bs)
    _fill_tree(cache, pool, rng, 2000, 64, bs)
    for num_blocks in (1, 4, 16, 64, 256, 1024):
        base = _prompt(rng, num_blocks, bs)
        ids = pool.allocate(0, num_blocks, "probe")
        cache.insert(base.tobytes(), ids, "", "probe")  # a full hit: walks every block
        us = _time_match(cache, base.tobytes(), num_blocks, 200) * 1e6
        print(f"  {num_blocks:5d} blocks ({num_blocks * bs:6d} tokens): {us:8.2f} us")
    print(f"radix match cost vs tree size (prompt 32 blocks, full hit, block {bs}):")
    for num_prompts in (10, 100, 1000, 10000):
        pool = BlockPool([PoolSpec(0, num_prompts * 32 + 64)])
        cache = RadixPrefixCache(pool, 0, bs)
        _fill_tree(cache, pool, rng, num_prompts, 32, bs)
        probe = _prompt(rng, 32, bs)
        cache.insert(probe.tobytes(), pool.allocate(0, 32, "probe"), "", "probe")
        us = _time_match(cache, probe.tobytes(), 32, 500) * 1e6
        print(f"  {num_prompts * 32 + 32:7d} cached blocks, {cache.num_nodes:6d} nodes: {us:8.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--only", choices=("step", "match"), default=None)
    args = parser.parse_args()
    if args.only in (None, "step"):
        bench_step(args)
    if args.only in (None, "match"):
        bench_match(args)


if __name__ == "__main__":
    main()
