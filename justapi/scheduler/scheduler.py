"""The scheduler core: a pure, deterministic object the scheduler process drives.

    add_request / abort_request  <- frontend     schedule() -> [(worker_id, StepPlan)]
    update(StepResult) -> TokenDeltas            mark_worker_unhealthy(worker_id)
    poll_grammars() -> TokenDeltas | None        (structured outputs: compiles finished)

A worker has at most one step in flight - two with overlap (overlap.py: the next step is
planned while the current one runs, a decoding request's next input then being a placeholder
the worker fills in); a request is in at most one step that has not started. An abort of an
in-flight request is deferred to its last step's result (the worker may still be writing its
blocks). No clocks, sockets or threads: times arrive in messages.
With pools on several hosts (a HostMap passed in) the router weighs prefixes cached on other
hosts and a request's prefix may be copied in first (cluster/imports.py).
Owns: the public API and step dispatch. Does not own: step choice (planner.py), results
(results.py), routing (router.py), state and transitions (state.py), imports (cluster/).
"""
from __future__ import annotations

import array
import dataclasses
import logging
from collections.abc import Sequence
from typing import Union

import numpy as np

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.config.spec import SpecConfig
from justapi.scheduler.batch import StepBatch
from justapi.scheduler.cluster.hosts import HostMap
from justapi.scheduler.cluster.imports import NoImports, PrefixImports
from justapi.scheduler.deltas import DeltaBuilder
from justapi.scheduler.faults import RequestFailures
from justapi.scheduler.invariants import check_state
from justapi.scheduler.overlap import OVERLAP_DEPTH, release_deferred
from justapi.scheduler.planner import StepPlanner
from justapi.scheduler.policy import sort_key
from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.results import ResultApplier
from justapi.scheduler.router import Router
from justapi.scheduler.spec.speculation import Speculation
from justapi.scheduler.spec.tree import chain_parents, check_tree, is_chain, keep_depth
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.stats import collect_stats
from justapi.scheduler.step_budget import multi_step_count
from justapi.scheduler.step_cost import StepFeatures
from justapi.scheduler.topology import ModelLimits, PoolSpec, Topology, WorkerSpec
from justapi.scheduler.worker_state import InFlightStep, WorkerState
from justapi.wire.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    BlocksCopied,
    CopyBlocks,
    Ready,
    StepPlan,
    StepResult,
    SubmitRequest,
    TokenDeltas,
)

logger = logging.getLogger(__name__)
NOT_A_STEP = -1  # step_id of deltas that no step produced (aborts, ill health)
WorkerOrder = Union[StepPlan, CopyBlocks]  # what schedule() sends to a worker (copies: PD, imports)


class Scheduler:
    """Continuous batching (or static batching) over one or more workers and pools."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, topology: Topology,
                 limits: ModelLimits, spec: SpecConfig | None = None,
                 hosts: HostMap | None = None) -> None:
        """hosts: the pools' hosts and copy costs when they are on several (launcher =
        "ray"): routing weighs prefixes cached elsewhere and imports them."""
        self.state = SchedulerState(config, cache, topology, limits)
        if spec is not None and spec.is_enabled:
            self.state.spec = Speculation(spec)
        self.planner = StepPlanner(self.state)
        self.results = ResultApplier(self.state)
        self.router = Router(self.state, hosts)
        self.imports: PrefixImports | NoImports = (
            NoImports() if hosts is None else PrefixImports(self.state, self.router, hosts))
        self.depth = OVERLAP_DEPTH if config.overlap and self.state.spec is None else 1
        # multi-step decoding: steps one plan may run (1: off; not with overlap or speculation)
        self.decode_steps = (config.decode_steps if self.depth == 1 and self.state.spec is None
                             else 1)

    # ------------------------------------------------------------------ frontend side
    def add_request(self, request: SubmitRequest) -> None:
        """Queue a tokenized request; ValueError (naming the value) if it can never run."""
        state = self.state
        rid = request.request_id
        if rid in state.requests or (state.structured is not None and rid in state.structured.pending):
            raise ValueError(f"request id {rid!r} is already in flight")
        tokens = _token_array(request.prompt_token_ids, rid)
        num_prompt_tokens = len(tokens)
        tokens.extend(_resumed_output(request))  # a resubmission after a scheduler restart
        limit = state.limits.max_context
        if len(tokens) + (0 if request.pooling else 1) > limit:
            raise ValueError(f"request {rid!r}: prompt of {len(tokens)} tokens leaves no room "
                             f"for output in the context of {limit} tokens")
        if request.pooling and (request.sampling.structured is not None or not len(tokens)):
            raise ValueError(f"request {rid!r}: a pooling request needs a prompt and no "
                             "output constraint")
        if request.sampling.structured is not None and state.structured is None:
            raise ValueError(f"request {rid!r}: structured outputs need the model's tokenizer, "
                             "which this server does not have")
        req = Request(rid, request.sampling, tokens, state.next_seq, int(request.priority))
        req.num_prompt_tokens = num_prompt_tokens
        req.has_reported = req.num_output_tokens > 0  # its cached-prompt figure went out before
        state.next_seq += 1
        req.sort_key = sort_key(state.config.policy, req.priority, req.seq)
        req.arrival_time_s = float(request.arrival_time_s)
        req.cache_salt = str(request.cache_salt)
        state.long_rope.take_table(req)  # (before routing probes the cache with its salt)
        req.pooling = request.pooling
        req.stop_ids = frozenset(request.sampling.stop_token_ids) | (
            frozenset() if request.sampling.ignore_eos else state.eos_token_ids)
        pool_id = self.router.choose_pool(req)
        if pool_id is None:
            raise ValueError(self._why_unplaceable(rid, len(tokens)))
        state.counters.num_requests += 1
        if state.structured is not None and request.sampling.structured is not None:
            state.structured.hold(req)  # queued by poll_grammars() once its grammar compiled
            return
        self._queue(req, pool_id)

    def _queue(self, req: Request, pool_id: int) -> None:
        state = self.state
        state.place(req, pool_id)
        state.requests[req.request_id] = req
        state.enqueue(req)
        self.imports.on_added(req)

    def poll_grammars(self, timeout_s: float = 0.0) -> TokenDeltas | None:
        """Queue the requests whose grammar has compiled (waiting up to timeout_s for one);
        a grammar that failed to compile finishes its request with "error". The process
        shell calls it every loop turn (the compile pool wakes the loop, process.py)."""
        structured = self.state.structured
        if structured is None or not structured.pending:
            return None
        deltas = DeltaBuilder(NOT_A_STEP)
        for req, error in structured.take_compiled(timeout_s):
            pool_id = None if error else self.router.choose_pool(req)
            if pool_id is not None:
                self._queue(req, pool_id)
            else:
                self._finish_unqueued(req, FINISH_ERROR, deltas, error or self._why_unplaceable(
                    req.request_id, req.num_tokens))
        return deltas.build() if len(deltas) else None

    def fail_request(self, request_id: str, stage: str, exc: Exception) -> TokenDeltas | None:
        """The process shell met `exc` while handling one request's message (its admission, its
        abort): that request fails alone, with whatever of it the core holds (faults.py).
        None when the core holds nothing of it (the shell answers for it)."""
        deltas = self.state.faults.fail_by_id(request_id, stage, exc)
        return deltas.build() if deltas is not None else None

    def take_failures(self) -> TokenDeltas | None:
        """Requests failed on their own while steps were planned (faults.py), not yet sent;
        the process shell calls it after schedule()."""
        deltas = self.state.faults.take()
        return deltas.build() if deltas is not None else None

    def _finish_unqueued(self, req: Request, reason: str, deltas: DeltaBuilder,
                         error: str = "") -> None:
        """Finish a request that never reached a queue (it waited for its grammar)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if reason == FINISH_ERROR:
            self.state.counters.num_errors += 1
            deltas.add_error(req, reason, error)
        else:
            self.state.counters.num_aborted += 1
            deltas.add(req, [], reason)

    def _why_unplaceable(self, rid: str, num_tokens: int) -> str:
        pools = [p for p in self.state.queues if self.state.healthy_workers(p)]
        if not pools:
            return f"request {rid!r}: no healthy worker"
        biggest = max(self.state.pool.num_blocks(p) for p in pools)
        needed = self.state.kv.num_blocks_for(num_tokens + 1)
        return (f"request {rid!r}: prompt of {num_tokens} tokens needs {needed} KV blocks, "
                f"the largest pool has {biggest}")

    def abort_request(self, request_id: str) -> TokenDeltas | None:
        """Finish a request with "abort", freeing all it holds. Returns the final delta now,
        or None when the request is unknown/finished or in flight (then the delta comes
        from update() once the worker is done with its blocks)."""
        self.imports.on_abort(request_id)
        req = self.state.requests.get(request_id)
        structured = self.state.structured
        held = structured.drop(request_id) if structured is not None else None
        if held is not None:  # still waiting for its grammar
            deltas = DeltaBuilder(NOT_A_STEP)
            self._finish_unqueued(held, FINISH_ABORT, deltas)
            return deltas.build()
        if req is None:
            return None
        if req.is_finishing:  # its finish is reported; its last step is still out
            return None
        if req.is_in_flight:
            req.is_abort_pending = True
            return None
        self.state.finish(req, FINISH_ABORT)
        self.state.counters.num_aborted += 1
        deltas = DeltaBuilder(NOT_A_STEP)
        deltas.add(req, [], FINISH_ABORT)
        return deltas.build()

    def set_draft_tokens(self, request_id: str, token_ids: Sequence[int],
                         parents: Sequence[int] | None = None) -> int:
        """Speculative decoding hook: drafts to verify in the request's next step (counted by
        the rule) - a chain, or a token tree with `parents` (justapi/scheduler/spec/tree.py). Nodes
        deeper than the room left before the request's finish are dropped; returns how many
        were kept."""
        req = self.state.requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING or req.is_in_flight:
            raise ValueError(f"request {request_id!r} is not running between steps")
        if not req.is_decode:
            raise ValueError(f"request {request_id!r} is still prefilling; drafts follow decode")
        tokens = [int(t) for t in token_ids]
        tree = [int(p) for p in parents] if parents is not None else chain_parents(len(tokens))
        check_tree(tokens, tree)
        room = req.final_len - req.num_tokens  # drafts past the finish could never be emitted
        req.draft_token_ids, tree = keep_depth(tokens, tree, max(0, room))
        req.draft_parents = [] if is_chain(tree) else tree
        return len(req.draft_token_ids)

    # ------------------------------------------------------------------ worker side
    def schedule(self) -> list[tuple[int, WorkerOrder]]:
        """Plans for every healthy worker with room for a step (none in flight; with overlap,
        fewer than two) that has something to do; the least loaded is planned first, so it
        takes the next waiting request. Import copies go first (they may go to busy workers:
        they run after the step)."""
        free = sorted((w for w in self.state.workers.values()
                       if w.is_healthy and len(w.in_flight) < self.depth_of(w)),
                      key=lambda w: (len(w.running), w.worker_id))
        out: list[tuple[int, WorkerOrder]] = list(self.imports.take_orders())
        for worker in free:
            while len(worker.in_flight) < self.depth_of(worker):
                try:
                    batch = self._plan(worker)
                    if not (len(batch) or batch.new_requests or worker.pending_drops):
                        break
                    plan = self._dispatch(worker, batch)
                except Exception as exc:  # not one request's: fail the step being planned
                    if self.state.faults.fail_planning(worker, self.planner.batch, exc):
                        continue  # without them the next plan starts clean
                    break
                out.append((worker.worker_id, plan))
        return out

    def depth_of(self, worker: WorkerState) -> int:
        """Steps the worker may have in flight (PdScheduler: 1 on prefill workers)."""
        return self.depth

    def _plan(self, worker: WorkerState) -> StepBatch:
        return self.planner.plan(worker)

    def _dispatch(self, worker: WorkerState, batch: StepBatch) -> StepPlan:
        state = self.state
        state.step_id += 1
        # the step in the cost formula's terms: the step budget's record, the multi-step cap
        features = batch.features() if self.planner.budget.is_enabled else None
        num_steps = self._num_steps(worker, batch, features)
        plan = self._build(worker, batch, num_steps)
        worker.pending_drops.clear()
        step_id = state.step_id
        ends = [start + num_tokens + num_steps - 1
                for start, num_tokens in zip(batch.starts, batch.num_tokens)]
        for req, end in zip(batch.reqs, ends):
            req.num_computed_tokens = end
            req.is_in_flight = True
            req.last_step_id = step_id
        counters = state.counters
        num_tokens = state.config.max_batched_tokens - batch.budget_tokens
        num_prefill = sum(n for n, p in zip(batch.num_tokens, batch.is_prefill) if p)
        counters.num_scheduled_tokens += num_tokens
        counters.num_prefill_tokens += num_prefill
        counters.num_decode_tokens += num_tokens - num_prefill
        counters.num_steps += 1
        counters.num_multi_step_plans += num_steps > 1
        worker.num_steps += 1
        worker.num_scheduled_tokens += num_tokens
        sampled = [req.request_id for req, s in zip(batch.reqs, batch.is_sampled) if s]
        worker.in_flight.append(InFlightStep(step_id, batch.reqs, batch.num_drafts,
                                             batch.is_sampled, sampled, ends,
                                             num_steps=num_steps))
        if features is not None:
            try:  # (the plan is in flight now: it must go out whatever the record does)
                self.planner.budget.dispatched(worker.worker_id, step_id, features)
            except Exception:
                logger.exception("step %d: its cost record failed", step_id)
        return plan

    def _build(self, worker: WorkerState, batch: StepBatch, num_steps: int) -> StepPlan:
        """The batch's plan with its token bitmasks. A request whose chunk does not match its
        tokens or blocks, or whose mask cannot be filled, fails alone and leaves the batch
        (faults.py); the plan is built again without it."""
        state = self.state
        faults = state.faults
        while True:
            try:
                plan = batch.build(state.step_id, state.pool.base(worker.pool_id),
                                   list(worker.pending_drops), num_steps)
                masks = state.structured.masks(batch) if state.structured is not None else None
            except RequestFailures as exc:
                for req, error in exc.failures:
                    faults.fail(req, exc.stage, error, batch=batch)
                continue
            if masks is None:
                return plan
            return dataclasses.replace(plan, bitmask_rows=masks[0], token_bitmask=masks[1])

    def _num_steps(self, worker: WorkerState, batch: StepBatch,
                   features: StepFeatures | None) -> int:
        """Steps the plan runs (multi-step decoding): decode_steps when every chunk decodes
        one sampled token of a request free of grammar, nobody waits for admission in the
        pool (a new prompt waits for the plan to end), and each request has that many tokens
        left and gets blocks for them without preempting anyone; else 1. Fewer where the
        worker's fitted step time makes the plan longer than MULTI_STEP_PLAN_S."""
        steps = self.decode_steps
        if steps <= 1 or not len(batch) or batch.new_requests \
                or self.state.queues[worker.pool_id]:
            return 1
        for req, num_tokens, is_prefill, is_sampled, num_drafts in zip(
                batch.reqs, batch.num_tokens, batch.is_prefill, batch.is_sampled,
                batch.num_drafts):
            if is_prefill or not is_sampled or num_tokens != 1 or num_drafts \
                    or req.grammar is not None or req.num_jumped:
                return 1
            steps = min(steps, req.final_len - len(req.token_ids),
                        self.state.long_rope.positions_left(req))  # (LongRoPE: short table)
        cost = self.planner.budget.cost(worker.worker_id)
        if cost is not None and features is not None:
            steps = multi_step_count(steps, cost.step_s(features))
        if steps <= 1:
            return 1
        for req, start in zip(batch.reqs, batch.starts):
            if not self.planner.allocate(req, start + steps):
                return 1  # (blocks taken so far serve the next steps)
        return steps

    def update(self, result: StepResult) -> TokenDeltas:
        """Apply a worker's result; returns the step's coalesced deltas (maybe empty). Its
        step time (per step of a multi-step plan) feeds the worker's step-cost fit
        (step_budget.py)."""
        worker = self.state.workers.get(result.worker_id)
        step = worker.in_flight[0] if worker is not None and worker.in_flight else None
        steps = step.num_steps if step is not None and step.step_id == result.step_id else 1
        self.planner.budget.observe(result.worker_id, result.step_id, result.step_time_s / steps)
        return self.results.apply(result)

    def copy_done(self, ack: BlocksCopied) -> TokenDeltas:
        """A worker's answer to a CopyBlocks order (an import's: its request queues again)."""
        deltas = DeltaBuilder(NOT_A_STEP)
        self.imports.on_copied(ack, deltas)
        return deltas.build()

    def mark_worker_unhealthy(self, worker_id: int) -> TokenDeltas:
        """Stop using a worker (the process shell has killed it or it died): its step in
        flight is discarded, its requests are re-queued for recompute (their tokens are
        known); with no healthy worker left in its pool, waiting requests move to another
        pool or fail. Assumes the worker writes no more KV."""
        state = self.state
        worker = state.workers.get(worker_id)
        if worker is None:
            raise ValueError(f"unknown worker {worker_id}")
        deltas = DeltaBuilder(NOT_A_STEP)
        if worker.is_healthy:
            self._lose_worker(worker, deltas)
        return deltas.build()

    def _lose_worker(self, worker: WorkerState, deltas: DeltaBuilder) -> None:
        state = self.state
        worker.is_healthy = False
        for step in worker.in_flight:
            worker.discarded_step_ids.add(step.step_id)
            for req in step.reqs:
                req.is_in_flight = False
            release_deferred(state, step)
        worker.in_flight.clear()
        for req in list(worker.running.values()):
            if req.is_finishing:  # reported already
                state.finish(req, req.finish_reason)
            elif req.is_abort_pending:
                state.finish(req, FINISH_ABORT)
                state.counters.num_aborted += 1
                deltas.add(req, [], FINISH_ABORT)
            else:
                state.preempt(req)
        worker.known.clear()
        worker.pending_drops.clear()
        if not state.healthy_workers(worker.pool_id):
            self._evacuate(worker.pool_id, deltas)
        self.imports.on_worker_lost(worker, deltas)

    def _evacuate(self, pool_id: int, deltas: DeltaBuilder) -> None:
        state = self.state
        queue = state.queues[pool_id]
        for req in sorted(queue, key=lambda r: r.sort_key):
            target = self.router.choose_pool(req, exclude=pool_id)
            if target is None:
                state.finish(req, FINISH_ERROR)
                state.counters.num_errors += 1
                deltas.add_error(req, FINISH_ERROR, f"no healthy worker can serve {req.request_id!r}")
                continue
            queue.remove(req)
            state.place(req, target)
            state.enqueue(req)

    def add_worker(self, ready: Ready) -> None:
        """A worker (re)joined: a new one, maybe with a new pool, or a healthy restart."""
        state = self.state
        pool_id = ready.pool.pool_id
        if pool_id not in state.queues:
            state.add_pool(PoolSpec(pool_id, ready.pool.num_blocks))
        elif state.pool.num_blocks(pool_id) != ready.pool.num_blocks:
            raise ValueError(f"worker {ready.worker_id} reports {ready.pool.num_blocks} blocks in "
                             f"pool {pool_id}, which has {state.pool.num_blocks(pool_id)}")
        worker = state.workers.get(ready.worker_id)
        if worker is None:
            state.add_worker(WorkerSpec(ready.worker_id, pool_id))
        elif worker.pool_id != pool_id:
            raise ValueError(f"worker {ready.worker_id} moved from pool {worker.pool_id} to {pool_id}")
        else:
            worker.is_healthy = True
        self.imports.add_pool(ready.pool)

    def set_draining(self, worker_id: int, is_draining: bool = True) -> int:
        """Drain (admit nothing new; running requests finish) or undrain a worker. Waiting
        requests of a pool where no worker admits any more move to a pool where one does
        (they wait where they are if there is none). Returns the requests it still runs."""
        state = self.state
        worker = state.workers.get(worker_id)
        if worker is None:
            raise ValueError(f"unknown worker {worker_id} (workers: {sorted(state.workers)})")
        worker.is_draining = bool(is_draining)
        for pool_id, queue in state.queues.items():
            if state.accepting_workers(pool_id):
                continue
            for req in sorted(queue, key=lambda r: r.sort_key):
                target = self.router.choose_pool(req, exclude=pool_id)
                if target is not None and state.accepting_workers(target):
                    queue.remove(req)
                    state.place(req, target)
                    state.enqueue(req)
        return len(worker.running)

    def tick(self, now_s: float) -> TokenDeltas | None:
        """The shell's clock, once per loop turn (PdScheduler's leases, imports' times)."""
        self.imports.on_tick(now_s)
        return None

    # ------------------------------------------------------------------ introspection
    def has_work(self) -> bool:
        """Unfinished requests, or drops a worker has not been told about yet."""
        return bool(self.state.requests) or self.imports.has_work() or any(
            w.pending_drops for w in self.state.workers.values() if w.is_healthy) or bool(
            self.state.structured is not None and self.state.structured.pending)

    def pool_ids(self) -> list[int]:
        return self.state.pool.pool_ids

    def stats(self) -> dict[str, float]:
        out = collect_stats(self.state)
        out.update(self.state.faults.stats())
        out.update(self.imports.stats())
        if self.state.structured is not None:
            out.update(self.state.structured.stats())
        out.update(self.planner.budget.stats())
        return out

    def worker_roles(self) -> dict[int, str]:
        """worker id -> mixed | prefill | decode (the health table shows it)."""
        return {w.worker_id: w.role for w in self.state.workers.values()}

    def problems(self) -> list[str]:
        """Why the core cannot serve as configured, one line each (PdScheduler: a side down)."""
        return []

    def check_invariants(self) -> None:
        check_state(self.state)

    def flush_prefix_cache(self, pool_id: int | None = None) -> int:
        """Drop every cached block no request holds (in one pool, or all); returns how many
        were freed."""
        caches = self.state.kv.caches
        if pool_id is not None and pool_id not in caches:
            raise ValueError(f"unknown pool {pool_id} (pools: {sorted(caches)})")
        chosen = [caches[pool_id]] if pool_id is not None else list(caches.values())
        return sum(cache.flush() for cache in chosen)

    def request(self, request_id: str) -> Request | None:
        """The live state of an unfinished request (tests, admin tools)."""
        return self.state.requests.get(request_id)


def _token_array(prompt_token_ids: object, request_id: str) -> array.array:
    prompt = np.asarray(prompt_token_ids)
    if prompt.ndim != 1 or len(prompt) == 0:
        raise ValueError(f"request {request_id!r}: the prompt must be a non-empty 1-D token list")
    if not np.issubdtype(prompt.dtype, np.integer) or int(prompt.min()) < 0 \
            or int(prompt.max()) >= 2**31:
        raise ValueError(f"request {request_id!r}: token ids must be int32 values >= 0")
    out = array.array("i")
    out.frombytes(np.ascontiguousarray(prompt, dtype=np.int32).tobytes())
    return out


def _resumed_output(request: SubmitRequest) -> array.array:
    """The output tokens a resubmitted request already delivered (empty for a new one)."""
    rid = request.request_id
    output = np.asarray(request.output_token_ids)
    out = array.array("i")
    if not len(output):
        return out
    if output.ndim != 1 or not np.issubdtype(output.dtype, np.integer) \
            or int(output.min()) < 0 or int(output.max()) >= 2**31:
        raise ValueError(f"request {rid!r}: delivered token ids must be int32 values >= 0")
    if len(output) >= request.sampling.max_tokens:
        raise ValueError(f"request {rid!r}: {len(output)} delivered tokens leave nothing of "
                         f"max_tokens {request.sampling.max_tokens}")
    out.frombytes(np.ascontiguousarray(output, dtype=np.int32).tobytes())
    return out
