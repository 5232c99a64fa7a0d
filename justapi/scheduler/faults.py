"""One request's failure inside the core, kept to that request.

An exception while a request is admitted, planned into a step, masked (its grammar's token
bitmask) or while its result is applied fails that request alone: it finishes with "error"
(its final delta carries the reason), whatever it holds is freed (its blocks at once, or when
the step in flight that still computes it lands), it leaves the step being planned, and the
failure is counted by stage (`/metrics`: justapi:request_failures_total{stage}). Everyone
else's step goes on. The frontend counts its own stage (detokenize) the same way.
Owns: that transition and the counts. Does not own: the state it changes (state.py) or
where the deltas go (the caller's DeltaBuilder, else the core hands them out:
Scheduler.take_failures).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from justapi.scheduler.deltas import DeltaBuilder
from justapi.scheduler.request import Request, RequestStatus
from justapi.wire.protocol import FINISH_ERROR

if TYPE_CHECKING:
    from justapi.scheduler.batch import StepBatch
    from justapi.scheduler.state import SchedulerState
    from justapi.scheduler.worker_state import WorkerState

logger = logging.getLogger(__name__)

STAGES = ("admit", "plan", "mask", "results", "detokenize")
"""Where a request can fail on its own (detokenize: in the frontend)."""
STAT_PREFIX = "request_failures_"
"""stats() key of a stage's count: request_failures_<stage>."""
NOT_A_STEP = -1


class RequestFailures(Exception):
    """Some requests of a step being built cannot be part of it (their chunk does not match
    their tokens, or their mask cannot be filled): each fails alone, the step is built again
    without them."""

    def __init__(self, stage: str, failures: list[tuple[Request, Exception]]) -> None:
        super().__init__(f"{len(failures)} requests failed while {_doing(stage)}")
        self.stage = stage
        self.failures = failures


class RequestFaults:
    """Fails one request after an exception in its own handling; counts them by stage."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.counts = dict.fromkeys(STAGES, 0)
        self.pending = DeltaBuilder(NOT_A_STEP)  # failures with no step's deltas to join
        self._last = 0  # id() of the exception whose traceback was logged last (not kept alive)

    def fail(self, req: Request, stage: str, exc: BaseException,
             deltas: DeltaBuilder | None = None, batch: StepBatch | None = None) -> None:
        """Finish req with "error" after `exc` in `stage` (a request already finished or
        whose finish is reported only gets its leftovers released)."""
        self.count(req.request_id, stage, exc)
        was_reported = req.is_finishing or req.is_finished
        worker_id = req.worker_id  # (release unbinds it)
        if not req.is_finished:
            self.release(req)
        if batch is not None:
            leave_batch(self.state, req, batch, worker_id)
        if was_reported:
            return
        self.state.counters.num_errors += 1
        out = deltas if deltas is not None else self.pending
        out.add_error(req, FINISH_ERROR, f"{stage} failed: {type(exc).__name__}: {exc}")

    def fail_by_id(self, request_id: str, stage: str, exc: BaseException) -> DeltaBuilder | None:
        """fail() for a request known by id (the process shell's catch); None, counted, when
        the core holds nothing of it."""
        state = self.state
        req = state.requests.get(request_id)
        if req is None and state.structured is not None:
            req = state.structured.pending.get(request_id)
        if req is None:
            self.count(request_id, stage, exc)
            state.counters.num_errors += 1
            return None
        deltas = DeltaBuilder(NOT_A_STEP)
        self.fail(req, stage, exc, deltas)
        return deltas

    def fail_planning(self, worker: WorkerState, batch: StepBatch, exc: BaseException) -> int:
        """Planning a step for `worker` failed outside any one request's part of it: the
        requests of that partial step fail (or, if it had none yet, the worker's running
        requests that no step in flight computes), so the next plan starts clean instead of
        meeting the same exception forever. Returns how many failed."""
        reqs = list(batch.reqs) + [r for r in batch.new_requests.values() if r not in batch]
        if not reqs:
            reqs = [r for r in worker.running.values() if not r.is_in_flight]
        logger.error("planning a step for worker %d failed (%s: %s): failing %d requests",
                     worker.worker_id, type(exc).__name__, exc, len(reqs), exc_info=exc)
        self._last = id(exc)
        for req in reqs:
            self.fail(req, "plan", exc, batch=batch)
        return len(reqs)

    def count(self, request_id: str, stage: str, exc: BaseException) -> None:
        """Log and count a failure (fail() does; alone for a request the core never held).
        One exception that fails many requests (a step's planning) logs its traceback once."""
        logger.error("request %r failed while %s: %s: %s", request_id, _doing(stage),
                     type(exc).__name__, exc, exc_info=exc if id(exc) != self._last else None)
        self._last = id(exc)
        self.counts[stage] += 1

    def release(self, req: Request) -> None:
        """Whatever req holds, freed now (or, in flight, when its step lands)."""
        state = self.state
        structured = state.structured
        if structured is not None:
            structured.drop(req.request_id)  # it may still wait for its grammar
        if req.request_id not in state.requests:  # never queued (a grammar's wait, a half add)
            req.status = RequestStatus.FINISHED
            req.finish_reason = req.finish_reason or FINISH_ERROR
            return
        if req.status is RequestStatus.WAITING:
            state.kv.free(req)  # a prefix hit taken while it was being admitted
            if req.queue_entry is None:  # half queued: nothing in the queue to remove
                req.status = RequestStatus.FINISHED
                del state.requests[req.request_id]
                return
        if req.is_in_flight:  # finishing: its blocks go when that step lands (overlap.py)
            req.finish_reason = req.finish_reason or FINISH_ERROR
        else:
            state.finish(req, req.finish_reason or FINISH_ERROR)

    def take(self) -> DeltaBuilder | None:
        """The failures not yet handed out (then a fresh builder)."""
        if not len(self.pending):
            return None
        pending, self.pending = self.pending, DeltaBuilder(NOT_A_STEP)
        return pending

    def stats(self) -> dict[str, int]:
        return {STAT_PREFIX + stage: count for stage, count in self.counts.items()}


def leave_batch(state: SchedulerState, req: Request, batch: StepBatch, worker_id: int) -> None:
    """Take a released req out of the step being planned for worker_id; admitted in it, the
    worker never hears of it (nor of its drop)."""
    if req in batch:
        batch.remove(req)
    batch.new_requests.pop(req.request_id, None)
    if req.request_id in batch.unseen_request_ids:
        batch.unseen_request_ids.discard(req.request_id)
        worker = state.workers.get(worker_id)
        if worker is not None:
            worker.pending_drops.pop(req.request_id, None)


def _doing(stage: str) -> str:
    return {"admit": "admitting it", "plan": "planning it", "mask": "masking its logits",
            "results": "applying its result", "detokenize": "detokenizing it"}[stage]
