"""A step the worker failed (it raised: StepResult.error) fails only the request that caused it.

A worker step computes many requests at once, and an exception in it (a kernel refusing a
shape, an input that trips a bug) tells nothing of which. Failing them all lets one poisonous
request take its whole batch down. Instead, of a failed step with more than one request in it,
each request not yet suspected is retried: re-queued as after a preemption (its tokens are kept,
its blocks freed, the prefix cache gives back what was computed), or, where a later step in
flight still computes it, when that step lands (its tokens are dropped). A retried request is
a suspect until it samples a token: suspects are admitted one at a time (no other suspect
running), so a suspect in a step that fails again is its cause, and fails alone. A request
alone in its failed step fails at once. A step that fails beside requests already waiting for
their retry (overlap: it was planned on their failed step's tokens) retries its others too.
Owns: that rule. Does not own: preemption (state.py) or applying a step's results (results.py).
"""
from __future__ import annotations

from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.state import SchedulerState


def retries_in(reqs: list[Request]) -> bool:
    """Whether a failed step with these requests retries its unsuspected ones (several live in
    it, or one beside a request its failure may have come from)."""
    active = [r for r in reqs if not (r.is_finishing or r.is_abort_pending)]
    live = [r for r in active if not r.retry_pending]
    return len(live) > 1 or len(live) < len(active)


def may_retry(req: Request) -> bool:
    return not req.is_suspect and req.status is RequestStatus.RUNNING


def retry(state: SchedulerState, req: Request) -> None:
    """req was in a failed step with others: re-queue it (now, or when its later step lands)."""
    req.is_suspect = True
    state.counters.num_step_retries += 1
    if req.is_in_flight:
        req.retry_pending = True
    else:
        state.preempt(req)


def landed(state: SchedulerState, req: Request) -> None:
    """A step computing a request waiting for its retry landed: its work is dropped; once no
    step computes it any more it is re-queued."""
    if not req.is_in_flight:
        state.preempt(req)  # (which ends retry_pending, as any preemption does)


def suspect_running(state: SchedulerState) -> bool:
    """A suspect is running (admitted, no token sampled since): the next one waits."""
    return any(req.is_suspect for worker in state.workers.values() for req in worker.running.values())
