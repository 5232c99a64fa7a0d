"""A StepPlan checked against this worker's pool and model before any kernel reads memory
through it: what the plan's own checks (justapi/wire/protocol.py: columns of matching
lengths, rows inside the step) cannot know.

    ids        no request twice in a step
    positions  every chunk (and every step of a multi-step plan) inside the model's context
    tables     each sequence's block table covers every position the step reads or writes
               (keys up to start + num_tokens + num_steps - 1, draft-model look-ahead too),
               and names only blocks of this worker's pool
    tokens     inside the vocabulary (PLACEHOLDER_TOKEN aside: the runner resolves it)
    drafts     at most num_tokens - 1 per chunk, only on sampled chunks; look-ahead >= 0
A plan that fails is refused (PlanError, the step's result carries the reason): nothing is
computed, nothing written. Vectorized numpy over the plan's columns: a few microseconds a
step (docs/reliability.md has the measured cost).
Owns: those checks. Does not own: the runner's request state (whether a request was
announced, where its history ends: runner.py checks that as it learns).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from justapi.wire.protocol import PLACEHOLDER_TOKEN, StepPlan


class PlanError(ValueError):
    """A plan this worker refuses: the message says which sequence and why."""


@dataclass(frozen=True)
class PlanLimits:
    """What a plan is checked against: this worker's pool and model."""

    num_blocks: int
    """Blocks in the worker's KV pool: a block id is in [0, num_blocks)."""
    block_size: int
    vocab_size: int
    max_context: int
    """Positions are in [0, max_context)."""


def check_plan(plan: StepPlan, limits: PlanLimits) -> None:
    """Raise PlanError naming the first problem of `plan` against `limits`."""
    if not plan.num_seqs:
        return
    if len(set(plan.request_ids)) != plan.num_seqs:
        raise PlanError(f"step {plan.step_id}: a request appears twice")
    starts = plan.start_positions.astype(np.int64)
    ends = starts + plan.num_tokens + (plan.num_steps - 1)  # one past the last position
    over = ends > limits.max_context
    if over.any():
        seq = int(np.argmax(over))
        raise PlanError(f"step {plan.step_id}: request {plan.request_ids[seq]!r} reaches position "
                        f"{int(ends[seq]) - 1}, beyond the context length {limits.max_context}")
    _check_tables(plan, ends, limits)
    _check_drafts(plan)
    _check_tokens(plan, limits.vocab_size)


def _check_tables(plan: StepPlan, ends: np.ndarray, limits: PlanLimits) -> None:
    """Tables long enough for every key, short enough to be a pool's, of the pool's blocks."""
    bs = limits.block_size
    needed = -(-(ends + plan.propose_counts) // bs)
    short = plan.num_blocks < needed
    if short.any():
        seq = int(np.argmax(short))
        raise PlanError(f"step {plan.step_id}: request {plan.request_ids[seq]!r} reads or writes "
                        f"{int(ends[seq] + plan.propose_counts[seq])} positions, its block table "
                        f"of {int(plan.num_blocks[seq])} blocks covers {int(plan.num_blocks[seq]) * bs}")
    if int(plan.num_blocks.max()) > limits.num_blocks:
        seq = int(np.argmax(plan.num_blocks))
        raise PlanError(f"step {plan.step_id}: request {plan.request_ids[seq]!r} has a block table "
                        f"of {int(plan.num_blocks[seq])} blocks, more than the pool's "
                        f"{limits.num_blocks}")
    blocks = plan.block_ids
    if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) >= limits.num_blocks):
        bad = int(blocks.min()) if int(blocks.min()) < 0 else int(blocks.max())
        raise PlanError(f"step {plan.step_id}: block id {bad} is outside the pool's "
                        f"[0, {limits.num_blocks})")


def _check_drafts(plan: StepPlan) -> None:
    drafts = plan.draft_counts
    if len(plan.num_draft_tokens):
        bad = (drafts < 0) | (drafts >= plan.num_tokens) | ((drafts > 0) & ~plan.sample_flags)
        if bad.any():
            seq = int(np.argmax(bad))
            raise PlanError(f"step {plan.step_id}: request {plan.request_ids[seq]!r} has "
                            f"{int(drafts[seq])} drafts in a chunk of {int(plan.num_tokens[seq])} "
                            f"tokens{'' if plan.sample_flags[seq] else ' that samples nothing'}")
    if len(plan.num_propose) and int(plan.num_propose.min()) < 0:
        raise PlanError(f"step {plan.step_id}: a negative draft-model look-ahead")


def _check_tokens(plan: StepPlan, vocab_size: int) -> None:
    for tokens in [plan.token_ids, *(new.token_ids for new in plan.new_requests)]:
        if not len(tokens):
            continue
        low, high = int(tokens.min()), int(tokens.max())
        if high >= vocab_size or (low < 0 and (low != PLACEHOLDER_TOKEN
                                               or tokens is not plan.token_ids)):
            bad = high if high >= vocab_size else low
            raise PlanError(f"step {plan.step_id}: token id {bad} is outside the vocabulary "
                            f"[0, {vocab_size})")
    for new in plan.new_requests:
        if not 0 <= new.num_prompt_tokens <= len(new.token_ids):
            raise PlanError(f"step {plan.step_id}: request {new.request_id!r} announces "
                            f"{new.num_prompt_tokens} prompt tokens of {len(new.token_ids)}")
