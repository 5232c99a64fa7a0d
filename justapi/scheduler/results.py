"""Applies a worker's StepResult: accept tokens, roll back rejected drafts, finish, cache.

A constrained request's grammar consumes each emitted token, then the tokens it forces are
appended too (jump-forward, structured.py). Finish checks, after each appended token, in this
order: the grammar refuses it -> "error", or is complete -> "stop"; a stop token id or (unless
ignore_eos) an end-of-generation id -> "stop"; max_tokens reached, or the context cap
(min(model context, pool capacity)) reached -> "length". Tokens after a stop are dropped.
An abort that arrived while the request was in flight finishes it here ("abort"), after
the worker is done writing its blocks. Newly full computed blocks enter the prefix cache
as soon as the result is back, so concurrent requests with a shared prefix share them.
With overlap (overlap.py) a request a later step still computes is finished, aborted or
failed at once but keeps its blocks until that step lands, whose tokens for it are dropped.
Owns: those rules. Does not own: the step's choice (planner.py) or the message shapes.
"""
from __future__ import annotations

import logging

import numpy as np

from justapi.scheduler import retries
from justapi.scheduler.deltas import DeltaBuilder
from justapi.scheduler.overlap import finish_or_hold, land, later_step
from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.spec.tree import follow, max_depth
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.worker_state import InFlightStep, WorkerState
from justapi.wire.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    StepResult,
    TokenDeltas,
    offsets,
)

logger = logging.getLogger(__name__)


class ResultApplier:
    """update(): from StepResult to request state and TokenDeltas."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.kv = state.kv
        self.worker: WorkerState | None = None  # whose result is being applied

    def apply(self, result: StepResult) -> TokenDeltas:
        worker = self.state.workers.get(result.worker_id)
        if worker is None:
            raise ValueError(f"StepResult from unknown worker {result.worker_id}")
        step = worker.in_flight[0] if worker.in_flight else None
        if step is None or step.step_id != result.step_id:
            if result.step_id in worker.discarded_step_ids:  # late answer of an unhealthy worker
                worker.discarded_step_ids.discard(result.step_id)
                return DeltaBuilder(result.step_id).build()
            raise ValueError(f"worker {result.worker_id} answered step {result.step_id}, "
                             f"expected {step.step_id if step else 'none'}")
        del worker.in_flight[0]
        land(self.state, step)
        self.worker = worker
        deltas = DeltaBuilder(result.step_id)
        error = result.error or self._malformed(step, result)
        if error:
            self._fail_step(step, error, deltas)
            return deltas.build()
        self._apply_chunks(step, result, deltas)
        self.state.counters.num_generated_tokens += len(deltas.token_ids)
        try:
            return deltas.build(result)
        except Exception as exc:  # the result's logprobs do not fit its tokens: send the tokens
            logger.error("step %d: logprobs dropped: %s: %s", result.step_id,
                         type(exc).__name__, exc)
            return deltas.build()

    @staticmethod
    def _malformed(step: InFlightStep, result: StepResult) -> str:
        if list(result.request_ids) != step.sampled_request_ids:
            return (f"step {step.step_id}: result lists {len(result.request_ids)} sampled "
                    f"requests, the plan sampled {len(step.sampled_request_ids)}")
        if step.num_steps > 1 and bool((result.num_sampled != step.num_steps).any()):
            return (f"step {step.step_id}: a plan of {step.num_steps} steps got "
                    f"{result.num_sampled.tolist()} tokens per request")
        return ""

    def _fail_step(self, step: InFlightStep, error: str, deltas: DeltaBuilder) -> None:
        """The worker failed the step: its requests are retried or fail (retries.py)."""
        retrying = retries.retries_in(step.reqs)
        for req in step.reqs:
            if req.is_finishing:
                self._drop(req)
            elif req.is_abort_pending:
                self._finish(req, FINISH_ABORT, [], deltas)
            elif req.retry_pending:
                retries.landed(self.state, req)
            elif retrying and retries.may_retry(req):
                retries.retry(self.state, req)
            else:
                self.state.counters.num_errors += 1
                finish_or_hold(self.state, req, FINISH_ERROR)
                deltas.add_error(req, FINISH_ERROR, error)

    def _drop(self, req: Request) -> None:
        """A finishing request's later step landed: its work is dropped; once no step
        computes it any more its blocks go."""
        if not req.is_in_flight:
            self.state.finish(req, req.finish_reason)

    def _cache(self, req: Request, num_written: int) -> None:
        """Cache the request's full blocks below num_written (a step in flight may read a
        duplicate it gives up: released when that step lands)."""
        later = later_step(self.worker, req)
        self.kv.cache_computed(req, num_written, later.deferred_blocks if later else None)

    def _apply_chunks(self, step: InFlightStep, result: StepResult, deltas: DeltaBuilder) -> None:
        pooled = dict(zip(result.pooled_request_ids, result.pooled_states)) \
            if result.pooled_request_ids else None
        sampled = result.sampled_token_ids.tolist()
        counts = iter(result.num_sampled.tolist())
        proposals = _proposals(result) if len(result.num_proposed) else None
        position = 0
        index = -1  # of the request among the sampled ones
        bs = self.state.block_size
        add_one = deltas.add_one
        for req, num_drafts, is_sampled, end in zip(step.reqs, step.num_drafts, step.is_sampled,
                                                    step.ends):
            count = 0
            try:  # a request's failure here is its own (faults.py), not the step's
                if not is_sampled:  # a prefill chunk short of the prompt's end
                    self._unsampled(req, end, pooled, deltas)
                    continue
                count = next(counts)
                index += 1
                if req.is_finishing:  # finished at an earlier step: this token is never emitted
                    self._drop(req)
                elif req.is_abort_pending:
                    self._finish(req, FINISH_ABORT, [], deltas)
                elif req.retry_pending:  # its earlier step failed: this one's token is not its
                    retries.landed(self.state, req)
                elif count == 1 and num_drafts == 0 and not req.draft_token_ids and req.grammar is None:
                    # The hot path (decode, or a prompt's last chunk): one token, _append inlined.
                    token = sampled[position]
                    token_ids = req.token_ids
                    token_ids.append(token)
                    reason = ""
                    if token in req.stop_ids:
                        reason = self._clamp(req, FINISH_STOP)
                    elif len(token_ids) >= req.final_len:
                        reason = self._clamp(req, FINISH_LENGTH)
                    if end // bs > req.num_cached_blocks:
                        self._cache(req, end)
                    if reason:
                        finish_or_hold(self.state, req, reason)
                    add_one(req, token, reason, position)
                elif step.num_steps > 1:
                    self._extend(req, sampled[position:position + count], deltas, position)
                else:
                    self._accept(req, num_drafts, sampled[position:position + count], deltas, position)
                if req.is_suspect and req.status is RequestStatus.RUNNING and not req.retry_pending:
                    req.is_suspect = False  # it sampled a token: not the failure's cause
                if proposals is not None and index in proposals and not req.is_finished:
                    assert self.state.spec is not None, "a worker proposed drafts with speculation off"
                    self.state.spec.record_proposal(req, *proposals[index])
            except Exception as exc:
                self.state.faults.fail(req, "results", exc, deltas)
            position += count

    def _unsampled(self, req: Request, end: int, pooled: dict[str, np.ndarray] | None,
                   deltas: DeltaBuilder) -> None:
        """A chunk that samples nothing (a prompt's part, or a pooling request's): its KV below
        `end` is written; a pooling request whose prompt is done finishes with its state."""
        if req.is_finishing:
            self._drop(req)
        elif req.is_abort_pending:
            self._finish(req, FINISH_ABORT, [], deltas)
        elif req.retry_pending:
            retries.landed(self.state, req)
        else:
            self._cache(req, end)
            if req.pooling and end >= req.num_prompt_tokens:
                self._pooled(req, pooled, deltas)

    def _pooled(self, req: Request, pooled: dict[str, np.ndarray] | None,
                 deltas: DeltaBuilder) -> None:
        """A pooling request's prompt is computed: it finishes with its pooled state (its
        blocks go; the full ones stay in the prefix cache)."""
        state = pooled.get(req.request_id) if pooled is not None else None
        if state is None:
            self.state.counters.num_errors += 1
            finish_or_hold(self.state, req, FINISH_ERROR)
            deltas.add_error(req, FINISH_ERROR, f"step {deltas.step_id}: the worker returned no "
                                                "pooled state for the request")
            return
        finish_or_hold(self.state, req, FINISH_STOP)
        deltas.add(req, [], FINISH_STOP)
        deltas.add_embedding(req.request_id, state)

    def _accept(self, req: Request, num_drafts: int, tokens: list[int],
                deltas: DeltaBuilder, first_index: int) -> None:
        drafts = req.draft_token_ids[:num_drafts]
        parents = req.draft_parents[:num_drafts]
        req.draft_token_ids, req.draft_parents = [], []
        num_accepted = len(tokens) - 1
        depth = _verified_depth(drafts, parents, tokens, num_accepted)
        if depth < 0:
            self.state.counters.num_errors += 1
            self.state.finish(req, FINISH_ERROR)
            deltas.add_error(req, FINISH_ERROR, f"step {deltas.step_id}: {len(tokens)} tokens "
                                                f"do not verify {num_drafts} drafts")
            return
        counters = self.state.counters
        counters.num_draft_tokens += num_drafts
        counters.num_accepted_draft_tokens += num_accepted
        if self.state.spec is not None:
            self.state.spec.verified(req, depth, num_drafts, num_accepted)
        if num_accepted < num_drafts:  # rejected drafts: their KV slots are garbage (a tree's
            # accepted path was moved to the positions of its tokens by the worker)
            req.num_computed_tokens -= num_drafts - num_accepted
            self.kv.truncate(req, req.num_computed_tokens)
        num_before = len(req.token_ids)
        req.num_jumped = 0
        reason = self._append(req, tokens)
        emitted = tokens[:len(req.token_ids) - num_before]
        num_forced = 0
        if req.grammar is not None and not reason:
            reason, num_forced = self._jump_forward(req)
            emitted = emitted + list(req.token_ids[len(req.token_ids) - num_forced:])
        self.kv.cache_computed(req)
        error = req.grammar.error if reason == FINISH_ERROR and req.grammar is not None else ""
        if reason:
            self.state.counters.num_errors += reason == FINISH_ERROR
            finish_or_hold(self.state, req, reason)
        deltas.add(req, emitted, reason, first_index, num_forced)
        if reason == FINISH_ERROR:
            deltas.errors[req.request_id] = f"the grammar refused token {emitted[-1]}: {error}"

    def _extend(self, req: Request, tokens: list[int], deltas: DeltaBuilder,
                first_index: int) -> None:
        """A multi-step plan's tokens for one request: appended until one finishes it (the
        KV of the positions after that is dropped with the request)."""
        num_before = len(req.token_ids)
        reason = self._append(req, tokens)
        self.kv.cache_computed(req)
        if reason:
            finish_or_hold(self.state, req, reason)
        deltas.add(req, tokens[:len(req.token_ids) - num_before], reason, first_index)

    def _jump_forward(self, req: Request) -> tuple[str, int]:
        """Append the tokens the request's grammar forces (structured.py): returns the finish
        reason they bring and how many were appended."""
        assert self.state.structured is not None
        forced = self.state.structured.forced_tokens(req)
        if not forced:
            return "", 0
        num_before = len(req.token_ids)
        reason = self._append(req, forced)
        req.num_jumped = 0 if reason else len(req.token_ids) - num_before
        return reason, len(req.token_ids) - num_before

    def _append(self, req: Request, tokens: list[int]) -> str:
        """Append tokens until one finishes the request; return the finish reason or "". A
        constrained request's grammar consumes each: it ends it when complete ("stop") or
        when it refuses the token ("error": the mask should have made that impossible)."""
        stop_ids = req.stop_ids
        token_ids = req.token_ids
        grammar = req.grammar
        for token in tokens:
            token_ids.append(token)
            if grammar is not None:
                if not grammar.consume(token):
                    return self._clamp(req, FINISH_ERROR)
                if grammar.is_stopped:
                    return self._clamp(req, FINISH_STOP)
            if token in stop_ids:
                return self._clamp(req, FINISH_STOP)
            if len(token_ids) >= req.final_len:  # max_tokens or the context cap
                return self._clamp(req, FINISH_LENGTH)
        return ""

    @staticmethod
    def _clamp(req: Request, reason: str) -> str:
        # Accepted drafts after the stop were computed but are not part of the output.
        req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids))
        return reason

    def _finish(self, req: Request, reason: str, tokens: list[int], deltas: DeltaBuilder) -> None:
        if reason == FINISH_ABORT:
            self.state.counters.num_aborted += 1
        finish_or_hold(self.state, req, reason)
        deltas.add(req, tokens, reason)


def _verified_depth(drafts: list[int], parents: list[int], tokens: list[int],
                    num_accepted: int) -> int:
    """The depth of the verified drafts' tree if tokens[:num_accepted] is a root path of it
    (a chain: a prefix of the drafts), else -1."""
    if num_accepted < 0 or num_accepted > len(drafts):
        return -1
    if not parents:
        return len(drafts) if tokens[:num_accepted] == drafts[:num_accepted] else -1
    if follow(drafts, parents, tokens[:num_accepted]) is None:
        return -1
    return max_depth(parents)


def _proposals(result: StepResult) -> dict[int, tuple[list[int], list[int]]]:
    """A draft model's proposals by index among the result's requests (non-empty ones)."""
    off = offsets(result.num_proposed)
    tokens = result.proposed_token_ids.tolist()
    parents = result.proposed_parents.tolist()
    return {i: (tokens[off[i]:off[i + 1]], parents[off[i]:off[i + 1]] if parents else [])
            for i in range(len(result.num_proposed)) if off[i + 1] > off[i]}
