"""The real Scheduler over random traces with fake workers that check every plan.

Invariants are checked after every event. Properties: every request finishes; outputs equal
the dense reference model's whatever the chunk size, budgets, pool size (preemption),
workers, pools, policy or cache state; nothing leaks; FCFS neither overtakes nor starves;
static batching never admits mid-batch.
"""
from __future__ import annotations

import functools
import math
import random

import pytest

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.scheduler.request import Request
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.records import SimResult
from justapi.scheduler.sim.simulation import Simulation
from justapi.scheduler.sim.trace import TraceRequest, TraceSpec, generate_trace
from justapi.scheduler.topology import ModelLimits, Topology

V = 64
EOS = (1,)
REF = ReferenceModel(V)


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...], max_tokens: int, stop: bool, max_len: int):
    return REF.generate(prompt, max_tokens, frozenset(EOS) if stop else frozenset(), max_len)


def random_config(rng: random.Random) -> dict:
    return dict(
        max_seqs=rng.choice([1, 2, 4, 8, 32]), max_prefill=rng.choice([1, 2, 4]),
        max_decode=rng.choice([1, 3, 32]), chunk_size=rng.choice([1, 3, 8, 64]),
        max_batched_tokens=rng.choice([4, 16, 64, 512]),
        policy=rng.choice(["fcfs", "fcfs", "priority", "lpm"]),
        scheduled=rng.random() < 0.85, lpm_max_wait_steps=rng.choice([4, 256]))


def random_trace(rng: random.Random, num_requests: int, max_prompt: int) -> list[TraceRequest]:
    spec = TraceSpec(num_requests=num_requests, rate_per_s=rng.choice([0.0, 20.0, 200.0]),
                     prompt_len=(1, max_prompt), output_len=(1, 24),
                     num_prefix_groups=rng.choice([0, 2, 4]), prefix_len=rng.randint(1, max_prompt),
                     abort_fraction=rng.choice([0.0, 0.2]), seed=rng.randrange(1 << 30))
    trace = generate_trace(spec)
    for item in trace:
        item.priority = rng.randint(0, 2)
        item.stop_on_eos = rng.random() < 0.3
    return trace


def build(config: dict, block_size: int, pool_blocks: int, num_workers: int, shared: bool,
          prefix_cache: bool = True, max_context: int = 4096) -> Scheduler:
    """One step in flight per worker unless the config asks for overlap."""
    topology = (Topology.shared_pool(pool_blocks, num_workers) if shared
                else Topology.pool_per_worker(pool_blocks, num_workers))
    return Scheduler(SchedulerConfig(**{"overlap": False, **config}),
                     CacheConfig(block_size=block_size,
                                                            enable_prefix_cache=prefix_cache),
                     topology, ModelLimits(max_context, EOS))


def check_result(sched: Scheduler, result: SimResult) -> None:
    """Every request finished with the reference output (a prefix of it if aborted)."""
    for rid, record in result.records.items():
        assert record.finish_reason, f"{rid} never finished"
        if record.finish_reason == "rejected":
            continue
        max_len = sched.state.limits.max_context
        cap = min(max_len, max(sched.state.pool_capacity_tokens(p) for p in sched.pool_ids()))
        expected, reason = reference(tuple(record.prompt), record.sampling.max_tokens,
                                     not record.sampling.ignore_eos, cap)
        if record.finish_reason == "abort":
            assert record.output == expected[:len(record.output)], f"{rid}: aborted output differs"
        else:
            assert (record.output, record.finish_reason) == (expected, reason), f"{rid} differs"


def check_no_leak(sched: Scheduler) -> None:
    stats = sched.stats()
    assert not sched.has_work() and stats["kv_blocks_in_use"] == 0
    assert stats["kv_blocks_free"] + stats["prefix_cache_blocks"] == stats["kv_blocks_total"]
    sched.flush_prefix_cache()
    assert sched.stats()["kv_blocks_free"] == stats["kv_blocks_total"]
    sched.check_invariants()


@pytest.mark.parametrize("seed, overlap, decode_steps",
                         [(s, False, 1) for s in range(240)]
                         + [(s, True, 1) for s in range(2000, 2060)]
                         + [(s, False, 2 + s % 6) for s in range(3000, 3060)])
def test_random_traces(seed, overlap, decode_steps):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_prompt = rng.choice([8, 24, 48])
    # Tiny pools force preemption: just enough for the longest request, or a little more.
    pool_blocks = math.ceil((max_prompt + 24) / block_size) + rng.choice([0, 1, 4, 16, 200])
    num_workers, shared = rng.choice([(1, True), (2, True), (3, True), (2, False)])
    sched = build({**random_config(rng), "overlap": overlap, "decode_steps": decode_steps},
                  block_size, pool_blocks, num_workers, shared, prefix_cache=rng.random() < 0.8)
    result = Simulation(sched, vocab_size=V, check_invariants=True).run(
        random_trace(rng, rng.randint(4, 18), max_prompt))
    check_result(sched, result)
    check_no_leak(sched)


def fixed_trace(seed: int) -> list[TraceRequest]:
    trace = generate_trace(TraceSpec(num_requests=24, rate_per_s=50.0, prompt_len=(1, 40),
                                     output_len=(1, 20), num_prefix_groups=3, prefix_len=24,
                                     seed=seed))
    for item in trace:
        item.stop_on_eos = True
    return trace


@pytest.mark.parametrize("seed", range(3))
def test_outputs_do_not_depend_on_how_requests_are_scheduled(seed):
    trace = fixed_trace(seed)
    layouts = [  # (config, block_size, pool_blocks, workers, shared, prefix cache)
        (dict(), 16, 512, 1, True, True),
        (dict(chunk_size=1, max_batched_tokens=4), 4, 64, 1, True, True),
        (dict(chunk_size=7, max_seqs=3), 2, 34, 1, True, True),  # tiny pool: preemption
        (dict(max_prefill=1, policy="lpm"), 8, 16, 3, True, True),
        (dict(max_decode=2, policy="priority"), 4, 20, 2, False, False),
        (dict(scheduled=False, max_seqs=5), 4, 64, 2, True, True),
        (dict(overlap=True), 16, 512, 1, True, True),  # the next step planned while one runs
        (dict(overlap=True, chunk_size=7, max_seqs=3), 2, 34, 1, True, True),
        (dict(overlap=True, max_prefill=1, policy="lpm"), 8, 16, 3, True, True),
        (dict(overlap=True, scheduled=False, max_seqs=5), 4, 64, 2, True, True),
        (dict(decode_steps=4), 16, 512, 1, True, True),  # multi-step decoding
        (dict(decode_steps=3, chunk_size=7, max_seqs=3), 2, 34, 1, True, True),
        (dict(decode_steps=5, max_prefill=1, policy="lpm"), 8, 16, 3, True, True),
    ]
    outputs = []
    for config, block_size, pool_blocks, workers, shared, cache in layouts:
        sched = build(config, block_size, pool_blocks, workers, shared, cache)
        result = Simulation(sched, vocab_size=V, check_invariants=True).run(trace)
        check_result(sched, result)
        check_no_leak(sched)
        outputs.append(result.outputs())
        if config.get("chunk_size") == 7:
            assert result.stats["num_preemptions"] > 0
    assert all(o == outputs[0] for o in outputs[1:])


def noisy_oracle(rng: random.Random, max_drafts: int):
    """Draft proposer: the reference continuation, each token wrong with probability 0.3."""
    def propose(req: Request) -> list[int]:
        k = rng.randint(0, max_drafts)
        if not k:
            return []
        guess = REF.generate(list(req.token_ids), k, frozenset(), 1 << 30)[0]
        return [t if rng.random() > 0.3 else (t + 1) % V for t in guess]
    return propose


@pytest.mark.parametrize("seed", range(8))
def test_speculative_drafts_never_change_outputs(seed):
    rng = random.Random(1000 + seed)
    sched = build(dict(max_batched_tokens=rng.choice([6, 64])), rng.choice([2, 4]),
                  rng.choice([24, 200]), rng.choice([1, 2]), True)
    sim = Simulation(sched, vocab_size=V, check_invariants=True,
                     draft_proposer=noisy_oracle(rng, 5))
    result = sim.run(random_trace(rng, 10, 20))
    check_result(sched, result)
    check_no_leak(sched)
    assert result.stats["num_accepted_draft_tokens"] > 0
    assert result.stats["num_accepted_draft_tokens"] < result.stats["num_draft_tokens"]


@pytest.mark.parametrize("pool_blocks", [512, 12])  # roomy, and preempting
def test_fcfs_neither_overtakes_nor_starves(pool_blocks):
    trace = generate_trace(TraceSpec(num_requests=40, rate_per_s=400.0, prompt_len=(1, 30),
                                     output_len=(1, 16), seed=5))
    # Strict arrival order is FCFS with the stall-free budget off (with it, the fewest
    # remaining tokens go first: test_stall_free_simulation.py).
    sched = build(dict(chunk_size=8, max_seqs=4, itl_target_ms=0), 4, pool_blocks, 1, True)
    result = Simulation(sched, vocab_size=V, check_invariants=True).run(trace)
    check_result(sched, result)
    records = sorted(result.records.values(), key=lambda r: (r.arrival_s, int(r.request_id[4:])))
    admitted = sorted(records, key=lambda r: (r.first_scheduled_step, int(r.request_id[4:])))
    assert [r.request_id for r in admitted] == [r.request_id for r in records]
    # Each step serves the oldest running request, so a request waits at most for the work
    # of the requests that arrived before it (recompute after preemption included).
    work = 0
    for record in records:
        assert record.queue_steps <= work + 1, f"{record.request_id} starved"
        work += (math.ceil(len(record.prompt) / 8) + record.sampling.max_tokens) * (
            1 if pool_blocks > 100 else 3)


def test_static_batches_never_admit_mid_batch():
    trace = fixed_trace(11)
    sched = build(dict(scheduled=False, max_seqs=4), 4, 64, 2, True)
    result = Simulation(sched, vocab_size=V, check_invariants=True, record_plans=True).run(trace)
    check_result(sched, result)
    batch: dict[int, set[str]] = {0: set(), 1: set()}
    for plan in result.plans:
        if plan.new_request_ids:
            unfinished = [rid for rid in batch[plan.worker_id]
                          if result.records[rid].finish_s > plan.time_s]
            assert not unfinished, f"worker {plan.worker_id} admitted mid-batch"
            batch[plan.worker_id] = set(plan.new_request_ids)
        assert set(plan.request_ids) <= batch[plan.worker_id]


def test_trace_round_trip_and_simulate_tool(tmp_path):
    import io
    import subprocess
    import sys

    from justapi.scheduler.sim.trace import dump_trace, load_trace

    trace = fixed_trace(4)
    buffer = io.StringIO()
    dump_trace(trace, buffer)
    assert load_trace(io.StringIO(buffer.getvalue())) == trace
    path = tmp_path / "trace.jsonl"
    path.write_text(buffer.getvalue())
    done = subprocess.run(
        [sys.executable, "-m", "tools.simulate", "--trace", str(path), "--pool-blocks", "64",
         "--block-size", "4", "--workers", "2", "--compare-static", "--check-invariants",
         "--per-request", "3"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "== continuous batching" in out and "== static batching" in out
    for needle in ("steps", "seqs/step", "prefix cache hit ratio", "preemptions", "TTFT s",
                   "TPOT st", "queue s", "req-0"):
        assert needle in out
    bad = subprocess.run([sys.executable, "-m", "tools.simulate"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 2 and "--trace" in bad.stderr
