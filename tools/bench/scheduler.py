"""Benchmark the scheduler core (pure Python, no model): cost of schedule() + update() per
step with many running and waiting requests, and of radix `match` against prompt length and
tree size. Prints figures; docs/scheduler.md records them with this command.

    python -m tools.bench scheduler [--running 256] [--waiting 10000] [--steps 300]
                                    [--workers 1 8] [--only step|match]
"""
from __future__ import annotations

import argparse
import array
import random
import statistics
import time

import numpy as np

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.sampling import SamplingParams
from justapi.scheduler.kv.block_pool import BlockPool
from justapi.scheduler.kv.radix_cache import RadixPrefixCache
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.topology import ModelLimits, PoolSpec, Topology
from justapi.wire.protocol import StepPlan, StepResult, SubmitRequest

VOCAB = 32000


def step_plans(sched: Scheduler) -> list[tuple[int, StepPlan]]:
    """schedule()'s orders: only steps here (a CopyBlocks order comes from PD, not used here)."""
    plans = sched.schedule()
    assert all(isinstance(plan, StepPlan) for _, plan in plans)
    return [(worker_id, plan) for worker_id, plan in plans if isinstance(plan, StepPlan)]


def fake_result(worker_id: int, plan: StepPlan, rng: random.Random) -> StepResult:
    """What a worker would answer: one token per sampled sequence (never EOS)."""
    ids = [rid for rid, flag in zip(plan.request_ids, plan.sample_flags) if flag]
    return StepResult(step_id=plan.step_id, worker_id=worker_id, request_ids=ids,
                      num_sampled=np.ones(len(ids), dtype=np.int32),
                      sampled_token_ids=np.asarray([rng.randrange(2, VOCAB) for _ in ids],
                                                   dtype=np.int32))


def loaded_scheduler(args: argparse.Namespace, num_workers: int) -> Scheduler:
    """running requests decoding (prompts prefilled), `waiting` more queued behind them."""
    rng = random.Random(0)
    per_worker = args.running // num_workers
    config = SchedulerConfig(max_seqs=per_worker, max_decode=per_worker, max_prefill=4,
                             chunk_size=512, max_batched_tokens=per_worker + 2048,
                             overlap=False)  # a round: one step per worker, planned and applied
    blocks_per_req = -(-(args.prompt_len + 400) // args.block_size)
    sched = Scheduler(config, CacheConfig(block_size=args.block_size),
                      Topology.shared_pool(args.running * blocks_per_req * 2, num_workers),
                      ModelLimits(8192, (0,)))
    for i in range(args.running + args.waiting):
        prompt = np.asarray([rng.randrange(2, VOCAB) for _ in range(args.prompt_len)], np.int32)
        sched.add_request(SubmitRequest(f"r{i}", prompt,
                                        SamplingParams(max_tokens=rng.randint(50, 400))))
    while sched.stats()["num_requests_running"] < args.running:  # warm up: admit and prefill
        for worker_id, plan in step_plans(sched):
            sched.update(fake_result(worker_id, plan, rng))
    return sched


def bench_step(args: argparse.Namespace, num_workers: int) -> None:
    rng = random.Random(2)
    sched = loaded_scheduler(args, num_workers)
    sched_s, update_s, seqs = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plans = step_plans(sched)
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
    print(f"step cost, {args.running} running / {args.waiting} waiting on {num_workers} "
          f"worker(s) sharing a pool (max-seqs {args.running // num_workers}; prompt "
          f"{args.prompt_len} tokens, block {args.block_size}), {args.steps} rounds of "
          f"schedule() + every update():")
    print(f"  sequences per round: mean {statistics.mean(seqs):.1f}; "
          f"still waiting {int(stats['num_requests_waiting'])}; preemptions "
          f"{int(stats['num_preemptions'])}")
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
    """Best of 5 runs (the machine is shared): seconds per match_length call."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            cache.match_length(tokens, "", num_blocks)
        best = min(best, (time.perf_counter() - start) / repeat)
    assert cache.match_length(tokens, "", num_blocks) == num_blocks
    return best


def _split_everywhere(cache: RadixPrefixCache, pool: BlockPool, tokens: array.array,
                      num_blocks: int, block_size: int) -> None:
    """Insert a sibling diverging after each block, so the path has one node per block."""
    for k in range(1, num_blocks):
        other = array.array("i", tokens[:k * block_size])
        other.extend([1] * block_size)  # token 1 never appears in the prompts
        holder = f"split{k}"
        match = cache.match(other.tobytes(), "", k)
        for block_id in match.block_ids:
            pool.acquire(block_id, holder)
        own = match.block_ids + pool.allocate(0, 1, holder)
        cache.insert(other.tobytes(), own, "", holder, start=match.node)


def bench_match(args: argparse.Namespace) -> None:
    rng = random.Random(1)
    bs = args.block_size
    print(f"radix match (full hit) vs prompt length; tree: 2000 other prompts of 64 blocks, "
          f"block {bs}:")
    print(f"  {'blocks':>6s} {'tokens':>7s} {'one node':>12s} {'node per block':>16s}")
    pool = BlockPool([PoolSpec(0, 2000 * 64 + 8 * 4096)])
    cache = RadixPrefixCache(pool, 0, bs)
    _fill_tree(cache, pool, rng, 2000, 64, bs)
    for num_blocks in (1, 4, 16, 64, 256, 1024):
        single = _prompt(rng, num_blocks, bs)
        cache.insert(single.tobytes(), pool.allocate(0, num_blocks, "single"), "", "single")
        split = _prompt(rng, num_blocks, bs)
        cache.insert(split.tobytes(), pool.allocate(0, num_blocks, "split"), "", "split")
        _split_everywhere(cache, pool, split, num_blocks, bs)
        one_us = _time_match(cache, single.tobytes(), num_blocks, 200) * 1e6
        many_us = _time_match(cache, split.tobytes(), num_blocks, 20) * 1e6
        print(f"  {num_blocks:6d} {num_blocks * bs:7d} {one_us:9.2f} us {many_us:13.2f} us")
    print(f"radix match (full hit, prompt of 32 blocks in 8 nodes) vs tree size, block {bs}:")
    for num_prompts in (10, 100, 1000, 10000, 30000):
        pool = BlockPool([PoolSpec(0, num_prompts * 32 + 64)])
        cache = RadixPrefixCache(pool, 0, bs)
        _fill_tree(cache, pool, rng, num_prompts, 32, bs)
        probe = _prompt(rng, 32, bs)
        cache.insert(probe.tobytes(), pool.allocate(0, 32, "probe"), "", "probe")
        for k in range(4, 32, 4):  # split the probe's path into 8 nodes
            cache.match(probe.tobytes(), "", k)
        us = _time_match(cache, probe.tobytes(), 32, 500) * 1e6
        print(f"  {cache.num_blocks:8d} cached blocks, {cache.num_nodes:6d} nodes: {us:8.2f} us")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench scheduler",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8],
                        help="worker counts to measure (running is split between them)")
    parser.add_argument("--only", choices=("step", "match"), default=None)
    args = parser.parse_args(argv)
    if args.only in (None, "step"):
        for num_workers in args.workers:
            bench_step(args, num_workers)
    if args.only in (None, "match"):
        bench_match(args)


if __name__ == "__main__":
    main()
