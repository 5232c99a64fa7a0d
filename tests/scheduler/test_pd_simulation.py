"""PdScheduler over random traces with plan-checking fake workers: invariants (block
conservation included) after every event; outputs identical to the colocated Scheduler's and
to the dense reference, on the zero-copy and the copy paths, through preemption, aborts,
lapsed leases, and workers killed (and restarted) in either pool at any moment."""
from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.scheduler.pd.scheduler import PdScheduler
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.fake_worker import FakeWorker
from justapi.scheduler.sim.harness import Harness
from justapi.scheduler.sim.simulation import Simulation
from justapi.scheduler.sim.trace import TraceRequest, TraceSpec, generate_trace
from justapi.scheduler.topology import ModelLimits, Topology
from justapi.wire.protocol import CopyBlocks, PoolInfo, Ready, StepPlan

V = 64
EOS = (1,)
REF = ReferenceModel(V)
LAYOUTS = [(1, 1, False), (1, 1, True), (2, 1, False), (1, 2, True), (2, 2, True), (1, 2, False)]


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...], max_tokens: int, stop: bool, max_len: int):
    return REF.generate(prompt, max_tokens, frozenset(EOS) if stop else frozenset(), max_len)


def random_config(rng: random.Random) -> dict:
    return dict(max_seqs=rng.choice([1, 2, 4, 32]), max_prefill=rng.choice([1, 2, 4]),
                max_decode=rng.choice([1, 3, 32]), chunk_size=rng.choice([1, 3, 8, 64]),
                max_batched_tokens=rng.choice([4, 16, 64, 512]),
                policy=rng.choice(["fcfs", "fcfs", "priority", "lpm"]))


def random_trace(rng: random.Random, num_requests: int, max_prompt: int) -> list[TraceRequest]:
    spec = TraceSpec(num_requests=num_requests, rate_per_s=rng.choice([0.0, 20.0, 200.0]),
                     prompt_len=(1, max_prompt), output_len=(1, 20),
                     num_prefix_groups=rng.choice([0, 2, 4]), prefix_len=rng.randint(1, max_prompt),
                     abort_fraction=rng.choice([0.0, 0.2]), seed=rng.randrange(1 << 30))
    trace = generate_trace(spec)
    for item in trace:
        item.priority = rng.randint(0, 2)
        item.stop_on_eos = rng.random() < 0.3
    return trace


def build_pd(config: dict, block_size: int, pool_blocks: int, layout: tuple[int, int, bool],
             prefix_cache: bool = True, lease_s: float = 30.0) -> PdScheduler:
    """overlap (decode workers plan ahead) only when the config asks for it."""
    topology = Topology.pd(pool_blocks, *layout)
    return PdScheduler(SchedulerConfig(**{"overlap": False, **config}),
                       CacheConfig(block_size=block_size, enable_prefix_cache=prefix_cache),
                       topology, ModelLimits(4096, EOS), lease_s=lease_s)


def check_output(rid: str, prompt: list[int], max_tokens: int, stop: bool, cap: int,
                 output: list[int], reason: str) -> None:
    expected, expected_reason = reference(tuple(prompt), max_tokens, stop, cap)
    if reason == "abort":
        assert output == expected[:len(output)], f"{rid}: aborted output differs"
    else:
        assert (output, reason) == (expected, expected_reason), f"{rid} differs"


def check_no_leak(sched: Scheduler) -> None:
    stats = sched.stats()
    assert not sched.has_work() and stats["kv_blocks_in_use"] == 0
    assert stats.get("pd_num_handoffs_pending", 0) == 0 and stats.get("pd_num_copies_in_flight", 0) == 0
    sched.flush_prefix_cache()
    assert sched.stats()["kv_blocks_free"] == stats["kv_blocks_total"]
    sched.check_invariants()


@pytest.mark.parametrize("seed, overlap", [(s, False) for s in range(120)]
                         + [(s, True) for s in range(1000, 1040)])
def test_random_traces_match_the_reference(seed, overlap):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_prompt = rng.choice([8, 24, 48])
    pool_blocks = math.ceil((max_prompt + 20) / block_size) + rng.choice([0, 1, 4, 16, 200])
    sched = build_pd({**random_config(rng), "overlap": overlap}, block_size, pool_blocks,
                     rng.choice(LAYOUTS), prefix_cache=rng.random() < 0.8)
    result = Simulation(sched, vocab_size=V, check_invariants=True).run(
        random_trace(rng, rng.randint(4, 18), max_prompt))
    cap = min(4096, pool_blocks * block_size)
    for rid, record in result.records.items():
        assert record.finish_reason, f"{rid} never finished"
        if record.finish_reason != "rejected":
            check_output(rid, record.prompt, record.sampling.max_tokens,
                         not record.sampling.ignore_eos, cap, record.output, record.finish_reason)
    assert result.stats["pd_num_handoffs"] > 0 or all(
        len(r.output) <= 1 or r.finish_reason != "length" for r in result.records.values())
    check_no_leak(sched)


def fixed_trace(seed: int) -> list[TraceRequest]:
    trace = generate_trace(TraceSpec(num_requests=24, rate_per_s=50.0, prompt_len=(1, 40),
                                     output_len=(1, 20), num_prefix_groups=3, prefix_len=24,
                                     seed=seed))
    for item in trace:
        item.stop_on_eos = True
    return trace


@pytest.mark.parametrize("seed", range(2))
def test_same_outputs_as_the_colocated_scheduler(seed):
    trace = fixed_trace(seed)
    colocated = Scheduler(SchedulerConfig(), CacheConfig(block_size=4),
                          Topology.shared_pool(128, 2), ModelLimits(4096, EOS))
    expected = Simulation(colocated, vocab_size=V).run(trace).outputs()
    for layout in LAYOUTS:
        for config, pool_blocks in ((dict(), 128), (dict(chunk_size=7, max_seqs=3), 20)):
            sched = build_pd(config, 4, pool_blocks, layout)
            result = Simulation(sched, vocab_size=V, check_invariants=True).run(trace)
            assert result.outputs() == expected, f"{layout} {config}"
            assert result.stats["pd_num_handoffs"] > 0
            copied = result.stats["pd_num_copies"] > 0
            assert copied == layout[2], f"{layout}: copies only between separate pools"
            check_no_leak(sched)


# ---------------------------------------------------------------------- chaos
class Chaos:
    """Drives a PdScheduler by hand: plans and copies complete in random order (a worker's
    plans in the order it got them: with overlap it may have two), workers die
    (their orders are lost: a dead worker writes nothing) and come back, aborts, a clock that
    lets leases lapse. At least one worker stays alive."""

    def __init__(self, rng: random.Random, sched: PdScheduler) -> None:
        self.rng = rng
        self.h = Harness(sched, vocab_size=V)
        self.sched = sched
        self.pending: list[tuple[int, object]] = []
        self.dead: dict[int, int] = {}  # worker -> events until it restarts
        self.now_s = 0.0
        self.num_kills = 0

    def run(self, max_events: int = 20_000) -> None:
        for _ in range(max_events):
            if not self.sched.has_work() and not self.pending:
                return
            self.event()
        raise AssertionError("not done: the scheduler is stuck")

    def event(self) -> None:
        rng = self.rng
        self._restart_due()
        roll = rng.random()
        if roll < 0.02:
            self._kill()
        elif roll < 0.04 and self.sched.state.requests:
            self.h.abort(rng.choice(sorted(self.sched.state.requests)))
        elif self.pending and roll < 0.65:
            index = rng.randrange(len(self.pending))
            worker_id, order = self.pending[index]
            if isinstance(order, StepPlan):  # its worker's oldest plan
                index = next(i for i, (w, o) in enumerate(self.pending)
                             if w == worker_id and isinstance(o, StepPlan))
            worker_id, order = self.pending.pop(index)
            self.h.complete(worker_id, order)  # type: ignore[arg-type]
        else:
            self.now_s += rng.choice([0.1, 1.0, 5.0])
            self.h.tick(self.now_s)
            self.pending.extend(self.h.schedule())

    def _kill(self) -> None:
        alive = [w for w in self.sched.state.workers.values() if w.is_healthy]
        if len(alive) < 2:
            return
        victim = self.rng.choice(alive).worker_id
        self.pending = [(w, o) for w, o in self.pending if w != victim]
        self.h.kill(victim)
        self.dead[victim] = self.rng.randint(1, 80)
        self.num_kills += 1

    def _restart_due(self) -> None:
        for worker_id in list(self.dead):
            self.dead[worker_id] -= 1
            if self.dead[worker_id] > 0:
                continue
            del self.dead[worker_id]
            worker = self.sched.state.workers[worker_id]
            store = self.h.stores[worker.pool_id]
            self.h.workers[worker_id] = FakeWorker(worker_id, store, V)  # a fresh process
            info = PoolInfo(worker.pool_id, "shm", "", "cpu", "float32", 1, store.num_blocks,
                            store.block_size, 1, 1)
            self.sched.add_worker(Ready(worker_id, 1, "fake", V, 4096, info))


@pytest.mark.parametrize("seed, overlap", [(s, False) for s in range(60)]
                         + [(s, True) for s in range(500, 520)])
def test_chaos_loses_nothing_and_leaks_nothing(seed, overlap):
    rng = random.Random(7000 + seed)
    block_size = rng.choice([2, 4])
    max_prompt = rng.choice([8, 24])
    pool_blocks = math.ceil((max_prompt + 20) / block_size) + rng.choice([1, 4, 64])
    sched = build_pd({**random_config(rng), "overlap": overlap}, block_size, pool_blocks,
                     rng.choice(LAYOUTS), lease_s=rng.choice([3.0, 30.0, 1e9]))
    chaos = Chaos(rng, sched)
    prompts: dict[str, tuple[list[int], int, bool]] = {}
    for i, item in enumerate(random_trace(rng, rng.randint(4, 14), max_prompt)):
        prompt, stop = item.tokens(i, V), item.stop_on_eos
        ignore_eos = not stop
        chaos.h.submit(f"r{i}", prompt, max_tokens=item.output_len, ignore_eos=ignore_eos)
        prompts[f"r{i}"] = (prompt, item.output_len, stop)
    chaos.run()
    cap = min(4096, pool_blocks * block_size)
    h = chaos.h
    assert set(h.finish_reasons) == set(prompts), "a request never finished"
    for rid, (prompt, max_tokens, stop) in prompts.items():
        assert h.finish_reasons[rid] != "error", h.errors.get(rid)
        check_output(rid, prompt, max_tokens, stop, cap, h.outputs[rid], h.finish_reasons[rid])
    check_no_leak(sched)


def test_chaos_covers_kills_orphans_and_copies():
    """Small pools, short leases, every layout: chaos does reach kills, lapsed leases,
    copies and preemptions (and still loses and leaks nothing)."""
    totals = {"kills": 0, "expired": 0, "copies": 0, "preemptions": 0}
    for seed in range(12):
        rng = random.Random(9000 + seed)
        sched = build_pd(dict(max_seqs=2, chunk_size=3), 2, 24, LAYOUTS[seed % len(LAYOUTS)],
                         lease_s=3.0)
        chaos = Chaos(rng, sched)
        for i in range(8):
            chaos.h.submit(f"r{i}", [2 + (i * 7 + j) % 60 for j in range(6 + i)], max_tokens=12,
                           ignore_eos=True)
        chaos.run()
        check_no_leak(sched)
        stats = sched.stats()
        totals["kills"] += chaos.num_kills
        totals["expired"] += int(stats["pd_num_leases_expired"])
        totals["copies"] += int(stats["pd_num_copies"])
        totals["preemptions"] += int(stats["num_preemptions"])
    assert all(v > 0 for v in totals.values()), totals
