"""Speculative decoding in the scheduler core: draft budgets, n-gram proposals, proposals from
the workers' draft models, acceptance statistics.

Before a worker's step is planned, `prepare` gives each of its decoding requests a budget
(tree levels and nodes, by the adaptive rule in justapi/scheduler/spec/budget.py). With the n-gram
proposer the drafts are proposed right there (pure token-id logic). With a draft model the
worker proposes: a plan asks it for `spec_propose` tokens for the request's next step
(StepPlan.num_propose) and the block table covers those look-ahead positions, where the
draft model writes its scratch KV; the proposals come back in the StepResult and
`record_proposal` makes them the request's drafts. `verified` counts every verification.
Owns: those decisions and the counters. Does not own: verification (the worker), the rule
that counts drafts (request.py), rollback (results.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from justapi.config.spec import MAX_GAMMA, SpecConfig
from justapi.scheduler.request import Request
from justapi.scheduler.spec.budget import PROBE_INTERVAL_STEPS, AcceptanceTracker, draft_levels
from justapi.scheduler.spec.ngram import NgramProposer
from justapi.scheduler.spec.tree import chain_parents, is_chain, keep_depth


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters: verifications with drafts, draft tokens, accepted tokens,
    and accepted tokens by position in the accepted path (0 = first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_GAMMA)
    num_proposed_tokens: int = 0
    num_budget_levels: int = 0  # levels granted by the adaptive rule (sum over decodes)
    num_budget_decodes: int = 0  # decodes the rule looked at

    def as_stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_proposed_tokens": self.num_proposed_tokens,
            "spec_decode_mean_acceptance_length":
                1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "spec_decode_draft_acceptance_rate":
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_decode_mean_budget_levels":
                self.num_budget_levels / self.num_budget_decodes if self.num_budget_decodes else 0.0,
        }
        for position, count in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_pos_{position}"] = count
        return out


class Speculation:
    """The spec-decode policy of one scheduler core (None on the core when it is off)."""

    def __init__(self, config: SpecConfig) -> None:
        if not config.is_enabled:
            raise ValueError("Speculation needs spec = 'ngram' or a draft model")
        self.config = config
        self.widths = config.widths
        self.level_costs = config.level_sizes()  # nodes per depth of the full-budget tree
        self.ngram = (NgramProposer(config.spec_ngram_min, config.spec_ngram_max)
                      if config.spec == "ngram" else None)
        self.tracker = AcceptanceTracker()
        self.counters = SpecCounters(accepted_per_pos=[0] * config.depth)

    @property
    def uses_draft_model(self) -> bool:
        return self.ngram is None

    # ------------------------------------------------------------------ before a step
    def prepare(self, decodes: Sequence[Request], num_other_rows: int = 0) -> int:
        """Budget (and n-gram drafts) for a worker's decoding requests; returns the most
        levels any got (what a request finishing its prompt this step is offered)."""
        levels = self._levels(decodes, num_other_rows)
        for req, num_levels in zip(decodes, levels):
            nodes = sum(self.level_costs[:num_levels])
            if self.ngram is not None:
                self._propose_ngram(req, nodes, num_levels)
                continue
            req.spec_propose = nodes
            if req.draft_token_ids and num_levels < len(self.level_costs):
                # Proposed last step with last step's budget: keep at least one level (a
                # probe's drafts get verified, so its acceptance is measured).
                self._cut(req, max(1, num_levels))
        return max(levels, default=len(self.level_costs))

    def _levels(self, decodes: Sequence[Request], num_other_rows: int) -> list[int]:
        full = len(self.level_costs)
        if not self.config.spec_adaptive:
            self.counters.num_budget_levels += full * len(decodes)
            self.counters.num_budget_decodes += len(decodes)
            return [full] * len(decodes)
        alphas = [self.tracker.alpha(req.spec_acceptance) for req in decodes]
        levels = draft_levels(alphas, self.level_costs, num_other_rows,
                              self.config.spec_fixed_cost_tokens)
        for i, req in enumerate(decodes):
            if levels[i]:
                req.spec_idle_steps = 0
            else:
                req.spec_idle_steps += 1
                if req.spec_idle_steps >= PROBE_INTERVAL_STEPS:  # re-measure now and then
                    levels[i], req.spec_idle_steps = 1, 0
        self.counters.num_budget_levels += sum(levels)
        self.counters.num_budget_decodes += len(decodes)
        return levels

    def nodes_for(self, num_levels: int) -> int:
        return sum(self.level_costs[:num_levels])

    def _propose_ngram(self, req: Request, nodes: int, num_levels: int) -> None:
        assert self.ngram is not None
        room = req.final_len - req.num_tokens  # drafts past the finish could never be emitted
        depth = min(num_levels, room)
        if nodes <= 0 or depth <= 0:
            req.draft_token_ids, req.draft_parents = [], []
            return
        sizes = self.config.level_sizes(nodes, depth)
        tokens, parents = self.ngram.propose(req.token_bytes(), sizes, self.widths[:len(sizes)])
        self._set(req, tokens, parents)

    def _cut(self, req: Request, num_levels: int) -> None:
        parents = req.draft_parents or chain_parents(len(req.draft_token_ids))
        tokens, parents = keep_depth(req.draft_token_ids, parents, num_levels)
        self._set(req, tokens, parents)

    def _set(self, req: Request, tokens: list[int], parents: list[int]) -> None:
        req.draft_token_ids = tokens
        req.draft_parents = [] if is_chain(parents) else parents
        self.counters.num_proposed_tokens += len(tokens)

    # ------------------------------------------------------------------ after a step
    def verified(self, req: Request, depth: int, num_drafts: int, num_accepted: int) -> None:
        """A step verified num_drafts drafts (a tree `depth` deep) and accepted num_accepted."""
        if num_drafts <= 0:
            return
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafts
        counters.num_accepted_tokens += num_accepted
        for position in range(min(num_accepted, len(counters.accepted_per_pos))):
            counters.accepted_per_pos[position] += 1
        self.tracker.observe(req.spec_acceptance, num_accepted, depth)

    def record_proposal(self, req: Request, tokens: list[int], parents: list[int]) -> None:
        """A worker's draft model proposed these for the request's next step (capped so none
        lies past the request's finish)."""
        if not tokens or not req.is_decode or req.num_jumped:
            return  # (after a grammar's forced tokens they would be for other positions)
        room = req.final_len - req.num_tokens
        parents = parents or chain_parents(len(tokens))
        tokens, parents = keep_depth(tokens, parents, max(0, room))
        self._set(req, tokens, parents)
