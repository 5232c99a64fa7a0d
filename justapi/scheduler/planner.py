"""Chooses one worker's next step.

Continuous (`scheduled=True`), decode-first like vLLM's "running before waiting":
  1. running decodes (1 token - plus any a grammar forced after it - + drafts each) - a
     prefill never takes their budget;
  2. running prefills / recomputes, oldest first, chunk_size tokens each at most;
  3. admissions from the pool's waiting queue in policy order, head-of-line, while
     max_seqs, max_prefill, the token budget and the pool's blocks allow, and while this
     worker runs fewer than its fair share of the pool's requests (running + waiting over
     the pool's healthy workers, rounded up). A request whose next uncached block a running
     request of this worker is still prefilling (the same tokens up to there) waits for it to
     be cached, so requests sharing a prompt that arrive together compute it once.
With overlap (overlap.py) the worker's current step is still in flight: its requests join the
next step when can_plan_ahead allows (a sampled one with a placeholder token), and one that
cannot get blocks waits for its step to land instead of being preempted.
LongRoPE (long_rope.py): a running request whose tokens outgrew the original context on the
short table is recomputed (queued again) instead of decoding; drafts stop at that context.
With the step budget on (step_budget.py), a step that decodes gives its prefill chunks a
time allowance from the worker's measured step cost, and 2 and 3 merge: prefills go fewest
remaining tokens first (aged), the next admission candidate taking its turn by the same rank.
Static (`scheduled=False`): when a worker has nothing running it admits a whole batch (each
request with blocks reserved for its full length, so it is never preempted); no request
joins until every one of them has finished.

Out of blocks (after evicting unreferenced cache leaves): preempt the newest running (or, with
PD, handed-off) request of the pool that is not in flight (un-scheduling it if needed). If only
requests in flight are newer, wait for them: reserve the pool's free blocks for this request
(newer requests may not allocate until it has its blocks). If it is itself the newest
holder, preempt it. So the oldest request always progresses and every request finishes.
Owns: those choices. Does not own: the state they change (SchedulerState), budgets (StepBatch).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from justapi.scheduler.batch import StepBatch
from justapi.scheduler.overlap import can_plan_ahead
from justapi.scheduler.policy import AdmissionOrder, choose_victim, has_newer_holder
from justapi.scheduler.priority import PriorityPreemption
from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.retries import suspect_running
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.step_budget import StepBudget, prefill_rank
from justapi.scheduler.worker_state import WorkerState

RUNNING = RequestStatus.RUNNING


class StepPlanner:
    """Fills a StepBatch for one idle worker."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.config = state.config
        self.kv = state.kv
        self.order = AdmissionOrder(state.config, state.kv)
        self.budget = StepBudget(state.config.itl_target_ms)
        self.faults = state.faults
        self.batch = StepBatch(state.config, state.block_size)  # the one being planned (or last)
        self.priority = PriorityPreemption(state)
        self._held: set[str] = set()  # priority: victims left out of this plan (priority.py)
        self._prefill_propose = 0  # draft-model tokens a prompt finishing this step asks for

    def plan(self, worker: WorkerState) -> StepBatch:
        batch = self.batch = StepBatch(self.config, self.state.block_size)
        self._prepare_spec(worker)
        if self.state.structured is not None:
            self._fit_grammar_drafts(worker)
        admits = self.state.admits(worker)  # draining or PD decode: only runs what it has
        self._held = self.priority.make_room(worker) if self.priority.is_enabled else set()
        if admits and not self.config.scheduled and not worker.running:
            self._admit_static(worker, batch)
        prefills = self._schedule_decodes(worker, batch)
        admits = admits and self.config.scheduled
        if self.budget.is_enabled:
            self._limit_prefill(worker, batch)
            self._prefill_shortest_first(worker, batch, prefills, admits)
            return batch
        self._schedule_prefills(worker, batch, prefills)
        if admits:
            self._admit(worker, batch)
        return batch

    # ------------------------------------------------------------------ running requests
    def _schedule_decodes(self, worker: WorkerState, batch: StepBatch) -> list[Request]:
        """Schedule the worker's decodes; return its running prefills (not yet scheduled)."""
        prefills: list[Request] = []
        is_capped = False
        long_rope = self.state.long_rope
        for req in list(worker.running.values()):
            if req.status is not RUNNING:
                continue  # preempted while this loop ran
            if req.is_in_flight and not (can_plan_ahead(req) and long_rope.may_plan_ahead(req)):
                continue  # overlap: it waits for its step in flight to land
            if self._held and req.request_id in self._held:
                continue  # priority: to be preempted once its step lands
            if long_rope.must_recompute(req):
                self.state.recompute(req)  # LongRoPE: prefilled again with the long table
                continue
            if req.num_computed_tokens < len(req.token_ids) - 1 - req.num_jumped or req.pooling:
                prefills.append(req)
                continue
            if not batch.has_decode_room:
                is_capped = True
                continue
            try:
                long_rope.fit_drafts(req)
                self._schedule_decode(req, batch)
            except Exception as exc:  # its own failure (faults.py), not the step's
                self.faults.fail(req, "plan", exc, batch=batch)
        if is_capped:  # round robin: the decodes served now go to the back of the line
            for req in batch.reqs:
                if worker.running.pop(req.request_id, None) is not None:
                    worker.running[req.request_id] = req
        return prefills

    def _schedule_decode(self, req: Request, batch: StepBatch) -> None:
        """The hot path (_schedule inlined): a decode needs a new block every block_size steps.
        Known tokens left: the last sampled one, then those a grammar forced (1 + num_jumped,
        fewer once a budget too small for all of them computed a part; with overlap, none
        yet: the placeholder of the step in flight counts as the one)."""
        num_computed = req.num_computed_tokens
        known = max(1, len(req.token_ids) - num_computed)
        num_tokens = min(known + len(req.draft_token_ids), batch.budget_tokens)
        end = num_computed + num_tokens
        bs = self.state.block_size
        if (end + bs - 1) // bs > len(req.block_ids):
            if num_tokens > known and not self.allocate(req, end):
                num_tokens = min(known, num_tokens)  # drafts never preempt anyone
                end = num_computed + num_tokens
            if not self.ensure_blocks(req, end, batch):
                return
        if req.num_jumped:
            batch.add(req, num_tokens, is_prefill=False)
        else:
            batch.add_decode(req, num_tokens)
        if req.spec_propose:
            self._lookahead(req, batch, req.spec_propose)

    def _schedule_prefills(self, worker: WorkerState, batch: StepBatch,
                           prefills: list[Request]) -> None:
        """Running prefills / recomputes, oldest first."""
        prefills.sort(key=lambda r: r.sort_key)
        for req in prefills:
            if not batch.has_prefill_room:
                break
            self._schedule_prefill(req, worker, batch)

    def _schedule_prefill(self, req: Request, worker: WorkerState, batch: StepBatch) -> None:
        if req.status is RUNNING and req.worker_id == worker.worker_id:  # not preempted since
            try:
                self._schedule(req, batch, is_prefill=True)
            except Exception as exc:  # its own failure (faults.py), not the step's
                self.faults.fail(req, "plan", exc, batch=batch)

    def _schedule(self, req: Request, batch: StepBatch, is_prefill: bool) -> bool:
        num_tokens = batch.chunk_len(req, is_prefill)
        if num_tokens <= 0:
            return False
        if not self.ensure_blocks(req, req.num_computed_tokens + num_tokens, batch):
            return False
        batch.add(req, num_tokens, is_prefill)
        self._lookahead(req, batch, self._prefill_propose)
        return True

    # ------------------------------------------------------------------ speculation
    def _prepare_spec(self, worker: WorkerState) -> None:
        """Draft budgets (and n-gram drafts) for the worker's decodes (speculation.py); a
        prompt finishing this step is offered as many draft-model tokens as the best decode."""
        spec = self.state.spec
        self._prefill_propose = 0
        if spec is None:
            return
        decodes = [r for r in worker.running.values() if r.status is RUNNING and r.is_decode]
        levels = spec.prepare(decodes)
        if spec.uses_draft_model:
            self._prefill_propose = spec.nodes_for(levels)

    def _fit_grammar_drafts(self, worker: WorkerState) -> None:
        """Constrained decodes' drafts, cut at the first one the grammar refuses."""
        structured = self.state.structured
        assert structured is not None
        for req in list(worker.running.values()):
            if req.grammar is not None and req.draft_token_ids and req.status is RUNNING \
                    and req.is_decode:
                try:
                    structured.fit_drafts(req)
                except Exception as exc:  # its own failure (faults.py)
                    self.faults.fail(req, "mask", exc)

    def _lookahead(self, req: Request, batch: StepBatch, num_propose: int) -> None:
        """Blocks for the positions the worker's draft model writes while proposing num_propose
        tokens after this chunk (only when free: look-ahead never preempts)."""
        if num_propose <= 0 or not batch.is_sampled[-1]:
            return
        if self.allocate(req, batch.starts[-1] + batch.num_tokens[-1] + num_propose):
            batch.set_propose(num_propose)

    def ensure_blocks(self, req: Request, num_tokens: int, batch: StepBatch) -> bool:
        """Blocks for req's first num_tokens tokens, preempting newer holders if needed; False
        when req must wait (it then reserves the pool, or was preempted itself)."""
        while not self.allocate(req, num_tokens):
            holders = self.state.holders(req.pool_id)
            victim = choose_victim(req, holders)
            if victim is not None:
                self._preempt(victim, batch)
                continue
            if req.is_in_flight:  # overlap: never preempted under its running step
                return False
            if has_newer_holder(req, holders):
                self._reserve(req)
            else:
                self._preempt(req, batch)
            return False
        return True

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """kv.allocate, unless an older request holds the pool's reservation."""
        pool_id = req.pool_id
        reserved = self.state.reservations[pool_id]
        if reserved is not None and reserved.is_in_flight:  # it got its blocks since
            reserved = self.state.reservations[pool_id] = None
        if (reserved is not None and reserved is not req and reserved.sort_key < req.sort_key
                and self.kv.num_new_blocks(req, num_tokens) > 0):
            return False
        if not self.kv.allocate(req, num_tokens):
            return False
        if reserved is req:
            self.state.reservations[pool_id] = None
        return True

    def _reserve(self, req: Request) -> None:
        current = self.state.reservations[req.pool_id]
        if current is None or req.sort_key < current.sort_key:
            self.state.reservations[req.pool_id] = req

    def _preempt(self, req: Request, batch: StepBatch) -> None:
        worker = self.state.workers.get(req.worker_id)  # None for a handed-off request
        if req in batch:
            batch.remove(req)
        self.state.preempt(req)
        if worker is not None and req.request_id in batch.unseen_request_ids:
            worker.pending_drops.pop(req.request_id, None)  # admitted in this plan: never sent

    # ------------------------------------------------------------------ step budget
    def _limit_prefill(self, worker: WorkerState, batch: StepBatch) -> None:
        """With decodes in the step: the prefill time allowance from the worker's cost, or
        while that is not measured yet, one chunk_size of prefill tokens."""
        if not batch.num_decode:
            return
        cost = self.budget.cost(worker.worker_id)
        if cost is None:
            batch.budget_tokens = min(batch.budget_tokens, self.config.chunk_size)
            return
        decodes = batch.features(decodes_only=True)
        batch.limit_prefill(cost, self.budget.allowance_s(cost, decodes))

    def _prefill_shortest_first(self, worker: WorkerState, batch: StepBatch,
                                prefills: list[Request], admits: bool) -> None:
        """Running prefills by prefill_rank, the next admission candidate merged in by its
        own rank (its remaining tokens after the cached prefix); admissions stay in queue
        order and head-of-line."""
        step_id = self.state.step_id
        prefills.sort(key=lambda r: (prefill_rank(r.num_tokens_wanted, step_id - r.enqueued_step),
                                     r.sort_key))
        admissions = self._admissions(worker, batch) if admits else iter(())
        candidate, rank = self._next_candidate(admissions)
        i = 0
        while batch.has_prefill_room and (candidate is not None or i < len(prefills)):
            if candidate is not None and (i == len(prefills) or rank < prefill_rank(
                    prefills[i].num_tokens_wanted, step_id - prefills[i].enqueued_step)):
                if not self._admit_one(candidate, worker, batch):
                    admissions = iter(())  # head of line: the rest wait behind it
                candidate, rank = self._next_candidate(admissions)
            else:
                self._schedule_prefill(prefills[i], worker, batch)
                i += 1

    def _next_candidate(self, admissions: Iterator[tuple[Request, int | None]]) -> tuple[Request | None, float]:
        req, cached = next(admissions, (None, None))
        if req is None:
            return None, 0.0
        if cached is None:
            try:
                cached = self._cached_blocks(req)
            except Exception:  # ranked as uncached: admitting it fails it (_admit_one)
                cached = 0
        remaining = req.num_tokens - cached * self.state.block_size
        return req, prefill_rank(remaining, self.state.step_id - req.enqueued_step)

    # ------------------------------------------------------------------ admissions
    def _admit(self, worker: WorkerState, batch: StepBatch) -> None:
        for req, _ in self._admissions(worker, batch):
            if not self._admit_one(req, worker, batch):
                return

    def _admissions(self, worker: WorkerState, batch: StepBatch) -> Iterator[tuple[Request, int | None]]:
        """Waiting requests in policy order while the worker may take more, each with its cached
        blocks where they were probed (else None); the caller admits each (or stops: a candidate
        not taken ends the order)."""
        queue = self.state.queues[worker.pool_id]
        max_seqs = self.config.max_seqs
        if not len(queue) or len(worker.running) >= max_seqs or not batch.has_prefill_room:
            return
        # Fair share: with one shared pool, no worker takes more than its part of the pool's
        # requests, so the other workers (planned next, or back from their step) get theirs.
        num_peers = len(self.state.accepting_workers(worker.pool_id))
        share = -(-(len(self.state.pool_running[worker.pool_id]) + len(queue)) // num_peers)
        # only this worker's prefills: another worker's step would compute req beside them
        # on its own cores, and a hung one must not hold req back until it is fenced
        prefilling = self._prefilling(worker.running.values())
        for req in self.order.candidates(queue, worker.pool_id, self.state.step_id):
            if (len(worker.running) >= min(max_seqs, share) or not batch.has_prefill_room):
                return
            if req.is_suspect and suspect_running(self.state):
                return  # suspects of a failed step run one at a time (retries.py)
            cached = None
            if prefilling and not req.needs_every_position:  # (it takes no cache hits)
                try:
                    cached = self._cached_blocks(req)  # probed once: a ranked order reuses it
                    joins = self._joins_a_prefill(req, cached, prefilling)
                except Exception as exc:  # its own failure (faults.py): the next may go
                    self.faults.fail(req, "admit", exc)
                    continue
                if joins:
                    continue  # not taken: a ranked order offers the next, queue order stops here
            yield req, cached
            if req.status is RUNNING:  # admitted: later candidates may wait for its prompt
                prefilling.extend(self._prefilling((req,)))

    def _prefilling(self, running: Iterable[Request]) -> list[Request]:
        """Those of `running` whose prompt has full blocks not cached yet (none without the
        prefix cache). Blocks below num_cached_blocks are in the tree, and a prompt is computed
        before any output, so each such block is cached within its prompt's prefill."""
        if not self.kv.enable_prefix_cache:
            return []
        bs = self.state.block_size
        return [r for r in running if r.num_cached_blocks < r.num_prompt_tokens // bs and not r.is_finishing]

    def _cached_blocks(self, req: Request) -> int:
        """Full blocks of req's tokens in the prefix cache (a read-only probe)."""
        return self.kv.probe(req.pool_id, req.token_bytes(), req.cache_salt, req.num_tokens)

    def _joins_a_prefill(self, req: Request, cached: int, prefilling: list[Request]) -> bool:
        """Is req's next uncached block inside a prompt one of `prefilling` is still computing
        (same tokens up to there, same salt)? Then req waits until that block lands in the
        prefix cache, and hits it, instead of computing the same KV beside it. Requests sharing
        a system prompt that arrive together otherwise each prefill it, as many in one step as
        its token budget holds."""
        bs = self.state.block_size
        if cached >= (req.num_tokens - 1) // bs:
            return False  # no full block left to share
        end = (cached + 1) * bs
        head = None
        for other in prefilling:
            if other.num_cached_blocks > cached or other.num_prompt_tokens < end or \
                    other.cache_salt != req.cache_salt or other.status is not RUNNING:
                continue
            head = req.token_ids[:end] if head is None else head
            if other.token_ids[:end] == head:
                return True
        return False

    def _admit_one(self, req: Request, worker: WorkerState, batch: StepBatch) -> bool:
        """Admit req with its first chunk; False (nothing held) when its blocks do not fit.
        An exception fails req alone (faults.py); the next candidate may go."""
        try:
            return self._try_admit(req, worker, batch)
        except Exception as exc:
            self.faults.fail(req, "admit", exc, batch=batch)
            return True

    def _try_admit(self, req: Request, worker: WorkerState, batch: StepBatch) -> bool:
        hit = self.kv.match_prefix(req)
        num_tokens = batch.chunk_len(req, is_prefill=True)
        if not self.allocate(req, req.num_computed_tokens + num_tokens):
            self.kv.free(req)
            return False
        self._admitted(req, worker, batch, hit)
        batch.add(req, num_tokens, is_prefill=True)
        self._lookahead(req, batch, self._prefill_propose)
        return True

    def _admit_static(self, worker: WorkerState, batch: StepBatch) -> None:
        queue = self.state.queues[worker.pool_id]
        for req in self.order.candidates(queue, worker.pool_id, self.state.step_id):
            if len(worker.running) >= self.config.max_seqs or (req.is_suspect and suspect_running(self.state)):
                return
            try:
                hit = self.kv.match_prefix(req)
                if not self.allocate(req, req.final_len - 1):  # the last token is never computed
                    self.kv.free(req)
                    return
                self._admitted(req, worker, batch, hit)
            except Exception as exc:  # its own failure (faults.py): the next may go
                self.faults.fail(req, "admit", exc, batch=batch)

    def _admitted(self, req: Request, worker: WorkerState, batch: StepBatch, hit: int) -> None:
        self.kv.record_lookup(req, hit)
        if not req.has_reported:
            req.num_cached_tokens = hit * self.state.block_size
        if req.request_id not in worker.pending_drops:  # else it holds stale state to drop
            batch.unseen_request_ids.add(req.request_id)
        self.state.admit(req, worker)
        batch.new_requests[req.request_id] = req
