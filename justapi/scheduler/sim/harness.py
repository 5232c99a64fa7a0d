"""Step-by-step driver of a Scheduler with fake workers, for tests and experiments.

Unlike the timed Simulation, the caller decides when plans are executed and results are
delivered (so a test can hold a step in flight, abort, then complete it).
Owns: the fake workers of one scheduler and the outputs seen so far. Does not own: checks of
plans (FakeWorker) or the scheduler.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.config.spec import SpecConfig
from justapi.sampling import SamplingParams
from justapi.scheduler.pd.scheduler import PdScheduler
from justapi.scheduler.scheduler import Scheduler, WorkerOrder
from justapi.scheduler.sim.cost_model import StepCostModel
from justapi.scheduler.sim.fake_model import FakeKvStore
from justapi.scheduler.sim.fake_worker import FakeWorker, Proposer
from justapi.scheduler.topology import ModelLimits, Topology
from justapi.wire.protocol import CopyBlocks, SubmitRequest, TokenDeltas, offsets

_SPEC_FIELDS = {f.name for f in dataclasses.fields(SpecConfig)}
GRAMMAR_WAIT_S = 0.05


class Harness:
    def __init__(self, scheduler: Scheduler, vocab_size: int = 64,
                 check_invariants: bool = True, proposer: Proposer | None = None,
                 step_cost: StepCostModel | None = None) -> None:
        """step_cost: results report its time for their plan, as real workers report theirs."""
        self.scheduler = scheduler
        self.step_cost = step_cost
        self.vocab_size = vocab_size
        self.check_invariants = check_invariants
        state = scheduler.state
        stores = {p: FakeKvStore(state.pool.num_blocks(p), state.block_size)
                  for p in state.pool.pool_ids}
        self.stores = stores
        self.workers = {w.worker_id: FakeWorker(w.worker_id, stores[w.pool_id], vocab_size,
                                                proposer, state.limits.long_rope_context)
                        for w in state.workers.values()}
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.cached_tokens: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self.embeddings: dict[str, np.ndarray] = {}  # pooling requests' pooled states

    def submit(self, request_id: str, prompt: Sequence[int], max_tokens: int = 8,
               priority: int = 0, cache_salt: str = "", pooling: str = "",
               **sampling: object) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)  # type: ignore[arg-type]
        self.scheduler.add_request(SubmitRequest(request_id, np.asarray(prompt, dtype=np.int32),
                                                 params, priority=priority, cache_salt=cache_salt,
                                                 pooling=pooling))
        self.outputs[request_id] = []
        self._check()

    def schedule(self) -> list[tuple[int, WorkerOrder]]:
        """Plans, after queueing every request whose grammar compiles (structured outputs:
        the harness waits for each compile, so a run's steps do not depend on thread timing)."""
        structured = self.scheduler.state.structured
        while structured is not None and structured.pending:
            deltas = self.scheduler.poll_grammars(timeout_s=GRAMMAR_WAIT_S)
            if deltas is not None:
                self.record(deltas)
        plans = self.scheduler.schedule()
        failed = self.scheduler.take_failures()  # requests that failed alone (faults.py)
        if failed is not None:
            self.record(failed)
        self._check()
        return plans

    def complete(self, worker_id: int, plan: WorkerOrder) -> TokenDeltas:
        """Execute the plan (or PD copy order) on its fake worker and deliver the result."""
        worker = self.workers[worker_id]
        if isinstance(plan, CopyBlocks):
            ack = worker.copy_blocks(plan, self.stores[plan.src_pool])
            deltas = self.scheduler.copy_done(ack)
        else:
            result = worker.execute(plan)
            if self.step_cost is not None:
                result = dataclasses.replace(result, step_time_s=self.step_cost.step_time_s(plan))
            deltas = self.scheduler.update(result)
        self.record(deltas)
        self._check()
        return deltas

    def tick(self, now_s: float) -> None:
        deltas = self.scheduler.tick(now_s)
        if deltas is not None:
            self.record(deltas)
        self._check()

    def kill(self, worker_id: int) -> None:
        """The worker died: the scheduler re-queues or fails what it had."""
        self.record(self.scheduler.mark_worker_unhealthy(worker_id))
        self._check()

    def step(self) -> list[tuple[int, WorkerOrder]]:
        """One schedule() and the completion of every plan it returned."""
        plans = self.schedule()
        for worker_id, plan in plans:
            self.complete(worker_id, plan)
        return plans

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is left; returns the number of schedule() calls."""
        for num in range(max_steps):
            if not self.scheduler.has_work():
                return num
            if not self.step():
                raise AssertionError("unfinished requests but no plan: the scheduler is stuck")
        raise AssertionError(f"not done after {max_steps} steps")

    def abort(self, request_id: str) -> None:
        deltas = self.scheduler.abort_request(request_id)
        if deltas is not None:
            self.record(deltas)
        self._check()

    def record(self, deltas: TokenDeltas) -> None:
        for rid, state in zip(deltas.embedding_request_ids, deltas.embeddings):
            assert rid not in self.embeddings, f"{rid} pooled twice"
            self.embeddings[rid] = state
        off = offsets(deltas.num_new_tokens)
        for i, rid in enumerate(deltas.request_ids):
            self.outputs.setdefault(rid, []).extend(deltas.token_ids[off[i]:off[i + 1]].tolist())
            if len(deltas.num_cached_tokens):
                self.cached_tokens[rid] = self.cached_tokens.get(rid, 0) + int(deltas.num_cached_tokens[i])
            if deltas.finish_reasons[i]:
                assert rid not in self.finish_reasons, f"{rid} finished twice"
                self.finish_reasons[rid] = deltas.finish_reasons[i]
                if rid in deltas.errors:
                    self.errors[rid] = deltas.errors[rid]

    def _check(self) -> None:
        if self.check_invariants:
            self.scheduler.check_invariants()


def build_scheduler(pool_blocks: int = 64, num_workers: int = 1, shared_pool: bool = True,
                    **options: object) -> Scheduler:
    """A Scheduler with small, test-friendly defaults (block_size 4, max_context 1024, EOS 1,
    one step in flight per worker: overlap=True plans the next while one runs).

    `options` go to CacheConfig, ModelLimits, SchedulerConfig or SpecConfig by field name."""
    topology = (Topology.shared_pool(pool_blocks, num_workers) if shared_pool
                else Topology.pool_per_worker(pool_blocks, num_workers))
    spec = {k: options.pop(k) for k in list(options) if k in _SPEC_FIELDS}
    return Scheduler(*_sections(topology, options), SpecConfig(**spec))  # type: ignore[arg-type, call-arg]


def build_pd_scheduler(pool_blocks: int = 64, num_prefill: int = 1, num_decode: int = 1,
                       separate_pools: bool = False, lease_s: float = 30.0,
                       **options: object) -> PdScheduler:
    """A PdScheduler (prefill workers first, then decode workers) with build_scheduler's
    defaults; separate_pools gives the decode workers their own pool (the copy path)."""
    topology = Topology.pd(pool_blocks, num_prefill, num_decode, separate_pools)
    config, cache, _, limits = _sections(topology, options)
    return PdScheduler(config, cache, topology, limits, lease_s)  # type: ignore[arg-type]


def _sections(topology: Topology, options: dict[str, object]) -> tuple[object, ...]:
    sections: dict[type, dict[str, object]] = {
        CacheConfig: {"block_size": 4}, ModelLimits: {"max_context": 1024, "eos_token_ids": (1,)},
        SchedulerConfig: {"overlap": False}}
    for name, value in options.items():
        owner = next((cls for cls in sections if name in {f.name for f in dataclasses.fields(cls)}),
                     None)
        if owner is None:
            raise TypeError(f"unknown option {name!r}")
        sections[owner][name] = value
    return (SchedulerConfig(**sections[SchedulerConfig]),  # type: ignore[arg-type]
            CacheConfig(**sections[CacheConfig]),  # type: ignore[arg-type]
            topology, ModelLimits(**sections[ModelLimits]))  # type: ignore[arg-type]
