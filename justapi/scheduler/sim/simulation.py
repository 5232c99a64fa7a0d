"""Replays a trace through the real Scheduler with fake workers on a modelled clock.

Event loop: at time t, submit arrivals and due aborts, ask schedule() for plans, and deliver
each one's result (executed on its FakeWorker then) at its start + cost(plan), reporting the
cost as a real worker reports its step time: a step starts at t, or when the worker's earlier
step is done (overlap); a PD copy order is done at t + copy cost. Jump to the next event
(arrival, abort, step or copy completion) and repeat. The scheduler's clock (tick) is the modelled time. Records per-request queue time,
TTFT and TPOT in modelled seconds and in steps (plans dispatched so far, all workers).
Owns: the event loop and the records. Does not own: scheduling (Scheduler), checks of
plans (FakeWorker), the cost formula (StepCostModel).
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from justapi.sampling import SamplingParams
from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.sim.cost_model import StepCostModel
from justapi.scheduler.sim.fake_model import FakeKvStore
from justapi.scheduler.sim.fake_worker import FakeWorker
from justapi.scheduler.sim.records import PlanRecord, RequestRecord, SimResult
from justapi.scheduler.sim.trace import TraceRequest
from justapi.wire.protocol import CopyBlocks, StepPlan, SubmitRequest, TokenDeltas, offsets

DraftProposer = Callable[[Request], list[int]]


class SimulationStuck(RuntimeError):
    """Unfinished requests, nothing in flight and nothing left to arrive: a scheduler bug."""


@dataclass
class Simulation:
    scheduler: Scheduler
    vocab_size: int = 64
    cost: StepCostModel = field(default_factory=StepCostModel)
    check_invariants: bool = False
    record_plans: bool = False
    draft_proposer: DraftProposer | None = None
    max_steps: int = 1_000_000

    def __post_init__(self) -> None:
        state = self.scheduler.state
        stores = {p: FakeKvStore(state.pool.num_blocks(p), state.block_size)
                  for p in state.pool.pool_ids}
        self.stores = stores
        self.workers = {w.worker_id: FakeWorker(w.worker_id, stores[w.pool_id], self.vocab_size,
                                                long_rope_context=state.limits.long_rope_context)
                        for w in state.workers.values()}
        self.now_s = 0.0
        self._busy_until: dict[int, float] = {}  # a worker runs its steps one after the other
        self._completions: list[tuple[float, int, int, StepPlan | CopyBlocks]] = []
        self._aborts: list[tuple[float, str]] = []
        self._result = SimResult()

    def run(self, trace: list[TraceRequest]) -> SimResult:
        arrivals = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, i))
        next_arrival = 0
        while True:
            while next_arrival < len(arrivals) and trace[arrivals[next_arrival]].arrival_s <= self.now_s:
                index = arrivals[next_arrival]
                self._submit(trace[index], index)
                next_arrival += 1
            self._abort_due()
            self._tick()
            self._dispatch()
            upcoming = [t for t in (
                trace[arrivals[next_arrival]].arrival_s if next_arrival < len(arrivals) else None,
                self._aborts[0][0] if self._aborts else None,
                self._completions[0][0] if self._completions else None) if t is not None]
            if not upcoming:
                break
            self.now_s = max(self.now_s, min(upcoming))
            self._complete_due()
        if self.scheduler.has_work() and self.scheduler.state.requests:
            raise SimulationStuck(f"{len(self.scheduler.state.requests)} requests never finished")
        self._result.duration_s = self.now_s
        self._result.stats = self.scheduler.stats()
        return self._result

    # ------------------------------------------------------------------ events
    def _submit(self, item: TraceRequest, index: int) -> None:
        rid = item.request_id or f"req-{index}"
        tokens = item.tokens(index, self.vocab_size)
        sampling = SamplingParams(max_tokens=item.output_len, temperature=0.0,
                                  ignore_eos=not item.stop_on_eos)
        record = RequestRecord(rid, self.now_s, self._result.num_steps, tokens, sampling)
        self._result.records[rid] = record
        try:
            self.scheduler.add_request(SubmitRequest(rid, np.asarray(tokens, dtype=np.int32),
                                                     sampling, self.now_s, item.priority))
        except ValueError as exc:
            record.finish(self.now_s, self._result.num_steps, "rejected", str(exc))
            return
        if item.abort_after_s is not None:
            heapq.heappush(self._aborts, (self.now_s + item.abort_after_s, rid))

    def _abort_due(self) -> None:
        while self._aborts and self._aborts[0][0] <= self.now_s:
            _, rid = heapq.heappop(self._aborts)
            deltas = self.scheduler.abort_request(rid)
            if deltas is not None:
                self._record(deltas)
            self._after_change()

    def _dispatch(self) -> None:
        if self.draft_proposer is not None:
            self._propose_drafts()
        result = self._result
        for worker_id, plan in self.scheduler.schedule():
            if isinstance(plan, CopyBlocks):  # PD hand-off: done after a modelled copy time
                done_s = self.now_s + self.cost.copy_time_s(len(plan.dst_block_ids))
                heapq.heappush(self._completions, (done_s, -plan.copy_id, worker_id, plan))
                continue
            result.num_steps += 1
            if result.num_steps > self.max_steps:
                raise SimulationStuck(f"more than {self.max_steps} steps")
            result.step_seqs.append(plan.num_seqs)
            result.step_tokens.append(int(np.sum(plan.num_tokens)))
            for new in plan.new_requests:
                result.records[new.request_id].scheduled(self.now_s, result.num_steps)
            if self.record_plans:
                result.plans.append(PlanRecord.of(worker_id, plan, self.now_s))
            done_s = max(self.now_s, self._busy_until.get(worker_id, 0.0)) + self.cost.step_time_s(plan)
            self._busy_until[worker_id] = done_s
            heapq.heappush(self._completions, (done_s, plan.step_id, worker_id, plan))
        failed = self.scheduler.take_failures()  # requests that failed alone while planned
        if failed is not None:
            self._record(failed)
        self._after_change()

    def _complete_due(self) -> None:
        while self._completions and self._completions[0][0] <= self.now_s:
            _, _, worker_id, plan = heapq.heappop(self._completions)
            worker = self.workers[worker_id]
            if isinstance(plan, CopyBlocks):
                ack = worker.copy_blocks(plan, self.stores[plan.src_pool])
                self._record(self.scheduler.copy_done(ack))  # type: ignore[attr-defined]
            else:  # the worker reports the modelled time, as a real one reports its own
                result = dataclasses.replace(worker.execute(plan),
                                             step_time_s=self.cost.step_time_s(plan))
                self._record(self.scheduler.update(result))
            self._after_change()

    def _tick(self) -> None:
        deltas = self.scheduler.tick(self.now_s)
        if deltas is not None and deltas.request_ids:
            self._record(deltas)
        self._after_change()

    def _propose_drafts(self) -> None:
        assert self.draft_proposer is not None
        for req in list(self.scheduler.state.requests.values()):
            if req.status is RequestStatus.RUNNING and not req.is_in_flight and req.is_decode:
                drafts = self.draft_proposer(req)
                if drafts:
                    self.scheduler.set_draft_tokens(req.request_id, drafts)

    def _after_change(self) -> None:
        if self.check_invariants:
            self.scheduler.check_invariants()

    def _record(self, deltas: TokenDeltas) -> None:
        off = offsets(deltas.num_new_tokens)
        for i, rid in enumerate(deltas.request_ids):
            record = self._result.records[rid]
            tokens = deltas.token_ids[off[i]:off[i + 1]].tolist()
            record.add_tokens(tokens, self.now_s, self._result.num_steps)
            if len(deltas.num_cached_tokens):
                record.num_cached_tokens += int(deltas.num_cached_tokens[i])
            if deltas.finish_reasons[i]:
                record.finish(self.now_s, self._result.num_steps, deltas.finish_reasons[i],
                              deltas.errors.get(rid, ""))
