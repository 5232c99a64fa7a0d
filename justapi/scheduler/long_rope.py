"""LongRoPE (Phi-3.5, Phi-3-128k) in the scheduler: which rope table a request's KV is computed
with, the prefix cache kept apart per table, and the recompute when a sequence outgrows the
model's original context - so greedy tokens are those of transformers' generate().

The worker rotates every row of a sequence announced (NewRequest) with more tokens than the
original context with the long table, a shorter one's with the short table
(workers/model/rotary.py). transformers' generate() for Phi-3 recomputes its whole cache with
the long table the first time the sequence outgrows the original context (its length passes
it while the cache holds at most that many positions: Phi3ForCausalLM.
prepare_inputs_for_generation), and keeps it from then on. Here, likewise:
- a request takes its table when it has no KV (added, preempted, recomputed): long once its
  tokens outgrow the original context (`uses_long_rope`, for good), else short. Its cache salt
  names the long table, so a block computed with one table is never a hit for the other;
- a request on the short table never computes a position past the original context: its drafts
  and multi-step plans stop there, and (overlap) no step is planned ahead of the step that
  reaches it;
- once its tokens outgrow it, it is recomputed: its blocks go (full ones stay cached under the
  short salt), it is queued again and its whole sequence is prefilled with the long table.
Owns: those rules. Does not own: the tables (the worker), the queue and release (state.py).
"""
from __future__ import annotations

import sys

from justapi.scheduler.request import Request
from justapi.scheduler.spec.tree import chain_parents, is_chain, keep_depth

LONG_TABLE_SALT = "#longrope-long"
"""Appended to the cache salt of a request on the long table (the short table keeps the salt
as it is, so models without LongRoPE and short sequences hash as before)."""


class LongRope:
    """The table rules of one scheduler core; a no-op for a model without LongRoPE."""

    def __init__(self, original_context: int) -> None:
        self.original_context = original_context  # 0: not LongRoPE

    def take_table(self, req: Request) -> None:
        """A request that holds no KV takes its table: the long one once its tokens outgrow the
        original context (then for good: it only grows), its salt saying so."""
        if self.original_context and not req.uses_long_rope \
                and req.num_tokens > self.original_context:
            req.uses_long_rope = True
            req.cache_salt += LONG_TABLE_SALT

    def must_recompute(self, req: Request) -> bool:
        """Its KV has the short table and its tokens outgrew the original context: the next
        step recomputes the whole sequence with the long table (transformers' generate())."""
        return (self.original_context > 0 and not req.uses_long_rope
                and req.num_tokens > self.original_context)

    def positions_left(self, req: Request) -> int:
        """Positions the request may still compute with its table: up to the original context
        on the short one (none past it), unbounded on the long one or without LongRoPE."""
        if not self.original_context or req.uses_long_rope:
            return sys.maxsize
        return max(0, self.original_context - req.num_computed_tokens)

    def may_plan_ahead(self, req: Request) -> bool:
        """Overlap: may a step be planned while its step in flight runs? Not when that step
        reaches the original context on the short table (the next one is a recompute)."""
        return self.positions_left(req) > 0 and not self.must_recompute(req)

    def fit_drafts(self, req: Request) -> None:
        """A decode's drafts on the short table stop at the original context: the deepest
        verified row is at position num_tokens - 1 + depth < original context."""
        if not req.draft_token_ids or not self.original_context or req.uses_long_rope:
            return
        room = max(0, self.original_context - req.num_tokens)
        parents = req.draft_parents or chain_parents(len(req.draft_token_ids))
        tokens, parents = keep_depth(req.draft_token_ids, parents, room)
        req.draft_token_ids = tokens
        req.draft_parents = [] if is_chain(parents) else parents
