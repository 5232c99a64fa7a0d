"""Overlap: a worker's next step is planned while its current one runs (SGLang's overlap
scheduler, vLLM's async scheduling), so the worker starts it as soon as the current is done.

    plan N -> worker | plan N+1 (planned now) | N lands: plan N+2 | N+1 lands: plan N+3 ...

The one-step lag is handled exactly:
- a decoding request's next input is the token step N is still sampling: the plan carries
  PLACEHOLDER_TOKEN and the worker puts in what it sampled (the token never makes a round trip);
- a request N finishes (stop token, EOS; `length` is foreseen and never planned past) is
  reported at once and keeps its blocks until N+1 lands; N+1's token for it is dropped;
- an abort, or a failed step, of a request that N+1 also computes finishes it the same way;
- prefix caching counts only positions whose KV is written (steps that landed), and a cached
  duplicate block a request gives up stays held until its step in flight has read it;
- no overlap for speculative decoding (drafts need the previous step's acceptance), for PD
  prefill workers (a computed prompt is handed off), or for a request that `waits_for_token`
  (a grammar's bitmask needs its previous token): such a request waits for its step to land;
- nor for a LongRoPE request whose step in flight reaches the original context on the short
  table: the step after it is a recompute with the long table (long_rope.py).
Owns: those rules. Does not own: planning (planner.py) or applying results (results.py).
"""
from __future__ import annotations

from justapi.scheduler.request import Request
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.worker_state import InFlightStep, WorkerState

OVERLAP_DEPTH = 2
"""Steps a worker may have in flight with overlap on: the one it runs and the next."""


def can_plan_ahead(req: Request) -> bool:
    """May a request that a step in flight computes join the next step? Not when it finishes
    there or waits for its token; a sampled one (num_computed_tokens == num_tokens: its next
    input is that step's token) only if that token cannot be its last by length."""
    if req.is_finishing or req.is_abort_pending or req.waits_for_token:
        return False
    return req.num_computed_tokens < req.num_tokens or req.num_computed_tokens + 1 < req.final_len


def finish_or_hold(state: SchedulerState, req: Request, reason: str) -> None:
    """Finish now; or, while a later step still computes it, mark it finishing (its finish is
    reported now, its blocks are released when that step lands: see land())."""
    if req.is_in_flight:
        req.finish_reason = reason
    else:
        state.finish(req, reason)


def land(state: SchedulerState, step: InFlightStep) -> None:
    """A step's result is back: its requests leave flight unless a later step computes them;
    blocks deferred to it are released."""
    step_id = step.step_id
    for req in step.reqs:
        req.is_in_flight = req.last_step_id > step_id
    release_deferred(state, step)


def release_deferred(state: SchedulerState, step: InFlightStep) -> None:
    for block_id, holder in step.deferred_blocks:
        state.pool.release((block_id,), holder)
    step.deferred_blocks.clear()


def later_step(worker: WorkerState | None, req: Request) -> InFlightStep | None:
    """The step in flight on the worker that computes req after the one that just landed."""
    if worker is None or not req.is_in_flight:
        return None
    return next((s for s in worker.in_flight if s.step_id == req.last_step_id), None)
