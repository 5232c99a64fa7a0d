"""ModelRunner: StepPlan in, StepResult out — the worker's whole data plane for one step.

Keeps per-request state (sampling params, token history for penalties) learned from
`plan.new_requests` and dropped on `plan.finished_request_ids`. Each chunk's tokens overwrite
the history at their positions (truncate to the chunk's start, then extend), so a rollback
after rejected speculative tokens, or a recompute after preemption, leaves it right. The last
token sampled for a request is kept with its position: a PLACEHOLDER_TOKEN at that position in
a plan made before its result (overlap) stands for it.
Steps with speculative drafts (or a draft model) go through workers/spec/step.py. Every plan
is checked against the pool and the model first (plan_check.py): a bad one is refused whole.
Owns: that state, turning a plan into tensors, picking logit rows. Does not own: block
allocation or scheduling (the scheduler), the forward math (model.py), sampling (sampler.py),
verification (verify.py).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from justapi.ops.timeline import Timeline
from justapi.wire.protocol import (
    PLACEHOLDER_TOKEN,
    StepPlan,
    StepResult,
    merge_step_results,
    offsets,
)
from workers.device_upload import upload
from workers.kv.pool import KVPool
from workers.model.attention import AttentionBackend, AttentionBatch
from workers.model.forward import DecoderModel
from workers.model.rotary import long_rope_rows
from workers.plan_check import PlanLimits, check_plan
from workers.pooling import pool_step
from workers.request_state import RequestState
from workers.sampler import Sampler, SamplerOutput, SamplingRow, apply_token_bitmask
from workers.spec.draft import DraftModel
from workers.spec.step import SpecContext, speculative_result, tree_layout
from workers.spec.tree import TreeLayout
from workers.spec.verify import Verifier

if TYPE_CHECKING:  # imports Triton where installed: only GPU workers build StepGraphs
    from workers.model.step_graphs import StepGraphs


NO_TOKENS = np.zeros(0, np.int64)
NO_TOKENS.flags.writeable = False


class ModelRunner:
    def __init__(self, model: DecoderModel, pool: KVPool, backend: AttentionBackend,
                 sampler: Sampler | None = None, worker_id: int = 0,
                 draft: DraftModel | None = None, graphs: StepGraphs | None = None) -> None:
        if pool.shape.num_layers != model.params.num_layers:
            raise ValueError(f"KV pool has {pool.shape.num_layers} layers, model {model.params.num_layers}")
        self.model = model
        self.pool = pool
        self.backend = backend
        self.sampler = sampler or Sampler()
        self.worker_id = worker_id
        self.requests: dict[str, RequestState] = {}
        self.draft = draft  # speculative decoding's draft model (workers/spec/draft.py), if any
        self.verifier = Verifier(self.sampler)
        self.timeline = Timeline("worker")  # off; the worker process hands in its own
        self.graphs = graphs  # GPU: uniform steps replayed from captured graphs (step_graphs.py)
        p = model.params
        self.limits = PlanLimits(pool.shape.num_blocks, pool.shape.block_size, p.vocab_size,
                                 p.max_context)  # every plan is checked against them
        self.pooling_ids: set[str] = set()  # pooling (embedding) requests this worker holds
        self._pooled: tuple[list[str], np.ndarray] | None = None  # this step's (pooling.py)

    @property
    def block_size(self) -> int:
        return self.pool.shape.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: forward every chunk, mask the constrained rows (structured outputs),
        sample the sequences whose sample flag is set (verifying their drafts,
        workers/spec/step.py, when there are any or a draft model). A multi-step plan runs its
        steps back to back, each one's sampled tokens the next one's input."""
        if plan.num_steps > 1:
            check_plan(plan, self.limits)  # the whole plan: its tables cover every step
            return merge_step_results([self.execute(step) for step in plan.sub_steps()])
        check_plan(plan, self.limits)  # before anything is learned, computed or written
        is_speculative = self.draft is not None or bool(np.any(plan.draft_counts > 0))
        # [sum over sampled (1 + drafts), vocab]: one row per sample without drafts
        logits = self.forward_logits(plan, tree_layout(plan) if is_speculative else None)
        if len(plan.bitmask_rows):
            apply_token_bitmask(logits, plan.bitmask_rows, plan.token_bitmask)
        if is_speculative:
            context = SpecContext(self.requests, self.pool, self.verifier, self.draft, self.worker_id)
            result = speculative_result(context, plan, logits)
        else:
            result = self._sample(plan, logits)
        if self._pooled is not None and self._pooled[0]:
            result = dataclasses.replace(result, pooled_request_ids=self._pooled[0],
                                         pooled_states=self._pooled[1])
        self._pooled = None
        self.forget(plan.finished_request_ids)
        self.timeline.mark("sample_end", plan.step_id)
        return result

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> StepResult:
        sampled = np.flatnonzero(plan.sample_flags)
        ids = [plan.request_ids[i] for i in sampled]
        ends = plan.start_positions[sampled] + plan.num_tokens[sampled]
        rows = [self._sampling_row(rid, int(end)) for rid, end in zip(ids, ends)]
        out = self.sampler.sample(logits, rows) if rows else SamplerOutput(np.zeros(0, np.int32))
        for request_id, end, token in zip(ids, ends.tolist(), out.token_ids.tolist()):
            self.requests[request_id].last_sampled = (end, token)  # a placeholder's meaning
        result = StepResult(step_id=plan.step_id, worker_id=self.worker_id, request_ids=ids,
                            num_sampled=np.ones(len(ids), np.int32), sampled_token_ids=out.token_ids)
        if out.logprobs is None or out.top_ids is None or out.top_logprobs is None:
            return result
        return dataclasses.replace(result, logprobs=out.logprobs, top_logprob_ids=out.top_ids,
                                   top_logprobs=out.top_logprobs)

    def forward_logits(self, plan: StepPlan, tree: TreeLayout | None = None) -> torch.Tensor:
        """Forward the plan and return fp32 logits of the last 1 + num_draft_tokens[i] positions
        of every sampled sequence i, in plan order: [sum over sampled (1 + drafts), vocab].
        `tree` masks the sequences whose drafts form a token tree."""
        if plan.num_seqs == 0:
            self._learn(plan, plan.token_ids)
            return torch.zeros(0, self.model.params.vocab_size)
        tokens = self._resolve(plan)
        self._learn(plan, tokens)
        batch = AttentionBatch(plan.start_positions.astype(np.int64), plan.num_tokens.astype(np.int64),
                               plan.num_blocks.astype(np.int64), plan.block_ids, self.block_size,
                               tree)
        long_rows = self._long_rope_rows(plan, batch)
        self.timeline.mark("forward_start", plan.step_id, plan.num_seqs)
        pools = bool(self.pooling_ids) and not self.pooling_ids.isdisjoint(plan.request_ids)
        with torch.inference_mode():
            # graphs rotate by position alone: a long prompt's LongRoPE prefill runs eagerly
            logits = self.graphs.run(batch, tokens, logit_rows(plan)) \
                if self.graphs and long_rows is None and not pools else None
            if logits is None:
                meta = self.backend.prepare(batch)
                token_ids = upload(tokens.astype(np.int64), self.model.device)
                kv_layers = [self.pool.layer(i) for i in range(self.pool.shape.num_layers)]
                hidden = self.model.forward(token_ids, kv_layers, self.backend, meta, long_rows)
                if pools:  # embeddings: their rows pooled before the head reads its own
                    self._pooled = pool_step(plan, hidden, self.requests, self.model.final_norm)
                rows = upload(logit_rows(plan), hidden.device)
                logits = self.model.logits(hidden[rows])
        self.timeline.mark("forward_end", plan.step_id, len(plan.token_ids))
        return logits

    def _long_rope_rows(self, plan: StepPlan, batch: AttentionBatch) -> torch.Tensor | None:
        """LongRoPE: the rows of sequences announced longer than the original context (all
        rotated with the long table), where some of them are within it; else None (rotary.py)."""
        scaling = self.model.params.rope_scaling
        if scaling.kind != "longrope":
            return None
        known = np.array([self.requests[rid].num_known_tokens for rid in plan.request_ids], np.int64)
        rows = long_rope_rows(scaling, batch.positions(), batch.num_tokens, known)
        return None if rows is None else torch.from_numpy(rows).to(self.model.device)

    # ------------------------------------------------------------------ request state

    def _resolve(self, plan: StepPlan) -> np.ndarray:
        """plan.token_ids with each PLACEHOLDER_TOKEN replaced by the token this worker sampled
        at that position in the request's previous step (planned before its result)."""
        tokens = plan.token_ids
        holes = np.flatnonzero(tokens == PLACEHOLDER_TOKEN)
        if not len(holes):
            return tokens
        tokens = tokens.copy()
        tok_off = offsets(plan.num_tokens)
        seqs = np.searchsorted(tok_off, holes, side="right") - 1
        for hole, seq in zip(holes.tolist(), seqs.tolist()):
            request_id = plan.request_ids[seq]
            position = int(plan.start_positions[seq]) + hole - int(tok_off[seq])
            state = self.requests.get(request_id)
            if state is None or state.last_sampled is None or state.last_sampled[0] != position:
                raise ValueError(f"step {plan.step_id}: request {request_id!r} has no sampled "
                                 f"token at position {position} for its placeholder")
            tokens[hole] = state.last_sampled[1]
        return tokens

    def _learn(self, plan: StepPlan, token_ids: np.ndarray) -> None:
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(
                new.sampling, new.num_prompt_tokens, [int(t) for t in new.token_ids],
                len(new.token_ids), pooling=new.pooling)
            if new.pooling:
                self.pooling_ids.add(new.request_id)
            if self.draft is not None:  # relearned (preemption): its proposal is stale
                self.draft.forget([new.request_id])
        tok_off = offsets(plan.num_tokens)
        for i, request_id in enumerate(plan.request_ids):
            state = self.requests.get(request_id)
            if state is None:
                raise ValueError(f"step {plan.step_id}: request {request_id!r} was never announced "
                                 "in new_requests (or already finished)")
            start = int(plan.start_positions[i])
            if start > len(state.token_ids):
                raise ValueError(f"request {request_id!r}: chunk starts at position {start} but only "
                                 f"{len(state.token_ids)} tokens are known")
            del state.token_ids[start:]
            state.token_ids.extend(token_ids[tok_off[i]:tok_off[i + 1]].tolist())

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.pooling_ids.discard(request_id)
        if self.draft is not None:
            self.draft.forget(request_ids)

    def _sampling_row(self, request_id: str, position: int) -> SamplingRow:
        state = self.requests[request_id]
        if not state.params.has_penalties:  # only penalties read the history
            return SamplingRow(state.params, NO_TOKENS, state.num_prompt_tokens, position)
        history = np.asarray(state.token_ids[:position], dtype=np.int64)
        return SamplingRow(state.params, history, state.num_prompt_tokens, position)


def logit_rows(plan: StepPlan) -> np.ndarray:
    """Flat row indices whose logits are needed: for each sampled sequence the last
    1 + num_draft_tokens rows of its chunk.

        rows:   | seq 0 (not sampled) | seq 1 .. [x x] | seq 2 [x] |   x = returned row
    """
    sampled = np.flatnonzero(plan.sample_flags)
    ends = offsets(plan.num_tokens)[1:][sampled]  # one past each sampled chunk's last row
    counts = plan.draft_counts[sampled].astype(np.int64) + 1
    # row j of sequence i's run: ends[i] - counts[i] + j, built without a loop over sequences
    firsts = np.repeat(ends - counts, counts)
    within = np.arange(int(counts.sum())) - np.repeat(offsets(counts)[:-1], counts)
    return firsts + within
