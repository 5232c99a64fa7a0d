"""One step with speculative decoding: verify every sampled sequence's drafts, put the accepted
path's KV where its tokens belong, run the draft model, and report tokens and proposals.

    forward (tree masks for token trees) -> verify (workers/spec/verify.py) -> move accepted KV
    -> draft model: forward known + accepted (+ bonus and proposals) -> StepResult

KV of a tree: its nodes were written at consecutive slots in node order; after verification
the accepted nodes' K/V are copied (every layer) to the slots of positions root + 1, root + 2,
... - a copy within the pool, never a recompute. Rejected nodes' slots hold garbage that the
scheduler's rollback leaves behind (num_computed_tokens ends at the accepted path). A chain's
accepted drafts are already in place.
Owns: that sequence of work. Does not own: the forward or the request state (the runner
passes its logits and a SpecContext in), the rules (verify.py), proposing (draft.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from justapi.wire.protocol import StepPlan, StepResult, offsets
from workers.kv.pool import KVPool
from workers.request_state import RequestState
from workers.sampler import SamplingRow, logprob_columns
from workers.spec.draft import DraftModel, DraftSeq, Proposal
from workers.spec.tree import TreeLayout, is_chain, verify_mask
from workers.spec.verify import Verified, VerifyInput, Verifier


@dataclass(frozen=True)
class SpecContext:
    """What a speculative step reads and writes of the runner's (workers/runner.py) state."""

    requests: Mapping[str, RequestState]  # histories are rewritten in place
    pool: KVPool  # accepted tree nodes' KV moves within it
    verifier: Verifier
    draft: DraftModel | None
    worker_id: int


def tree_layout(plan: StepPlan) -> TreeLayout | None:
    """Tree masks for the sequences whose drafts are not a chain."""
    if not len(plan.draft_parents):
        return None
    layout = TreeLayout()
    for i, num_drafts in enumerate(plan.draft_counts.tolist()):
        parents = plan.parents_of(i).tolist()
        if num_drafts and not is_chain(parents):
            layout.add(verify_mask(i, int(plan.num_tokens[i]), int(plan.start_positions[i]), parents))
    return layout or None


def speculative_result(context: SpecContext, plan: StepPlan, logits: torch.Tensor) -> StepResult:
    """The step after the forward: `logits` [sum over sampled (1 + drafts), vocab] as
    ModelRunner.forward_logits returns them with tree_layout(plan)."""
    sampled = np.flatnonzero(plan.sample_flags).tolist()
    items = _inputs(context, plan, sampled, logits)
    verified = context.verifier.verify(items)
    for seq, item, result in zip(sampled, items, verified):
        _settle(context, plan, seq, item, result)
    proposals = _draft_step(context, plan, sampled, verified) if context.draft is not None else {}
    return _result(context, plan, sampled, items, verified, proposals)


def _inputs(context: SpecContext, plan: StepPlan, sampled: list[int],
            logits: torch.Tensor) -> list[VerifyInput]:
    drafts = plan.draft_counts
    tok_off = offsets(plan.num_tokens)
    items, row = [], 0
    for seq in sampled:
        rid, num_drafts = plan.request_ids[seq], int(drafts[seq])
        state = context.requests[rid]
        end = int(plan.start_positions[seq] + plan.num_tokens[seq])
        root = end - 1 - num_drafts
        tokens = plan.token_ids[tok_off[seq + 1] - num_drafts:tok_off[seq + 1]].tolist()
        parents = plan.parents_of(seq).tolist()
        draws = context.draft.draws_for(rid, tokens, parents) if context.draft is not None else None
        items.append(VerifyInput(logits[row:row + 1 + num_drafts], state.params,
                                 state.token_ids[:root + 1], state.num_prompt_tokens, root,
                                 tokens, parents, draws))
        row += 1 + num_drafts
    return items


def _settle(context: SpecContext, plan: StepPlan, seq: int, item: VerifyInput,
            result: Verified) -> None:
    """The request's history holds the accepted path after the root; a tree's accepted KV
    moves to the slots of the positions it now holds."""
    root = item.root_position
    history = context.requests[plan.request_ids[seq]].token_ids
    del history[root + 1:]
    history.extend(result.tokens[:-1])
    moves = [(root + 1 + node, root + 1 + j) for j, node in enumerate(result.nodes) if node != j]
    if moves:
        table = plan.block_ids[offsets(plan.num_blocks)[seq]:offsets(plan.num_blocks)[seq + 1]]
        block_size = context.pool.shape.block_size
        context.pool.move_slots(_slots(table, [m[0] for m in moves], block_size),
                                _slots(table, [m[1] for m in moves], block_size))


def _slots(table: np.ndarray, positions: list[int], block_size: int) -> np.ndarray:
    pos = np.asarray(positions, dtype=np.int64)
    return table[pos // block_size].astype(np.int64) * block_size + pos % block_size


def _draft_step(context: SpecContext, plan: StepPlan, sampled: list[int],
                verified: list[Verified]) -> dict[str, Proposal]:
    """The draft model computes what the target now has (known chunk tokens + accepted
    drafts) and, when asked, the bonus token and its proposals."""
    assert context.draft is not None
    by_seq = dict(zip(sampled, verified))
    tok_off, blk_off = offsets(plan.num_tokens), offsets(plan.num_blocks)
    drafts, propose = plan.draft_counts, plan.propose_counts
    seqs = []
    for i, rid in enumerate(plan.request_ids):
        known = plan.token_ids[tok_off[i]:tok_off[i + 1] - int(drafts[i])].tolist()
        result = by_seq.get(i)
        num_propose = int(propose[i]) if result is not None else 0
        tokens = known + (result.tokens[:-1] if result is not None else [])
        if num_propose:
            assert result is not None
            tokens.append(result.tokens[-1])
        seqs.append(DraftSeq(rid, int(plan.start_positions[i]), tokens,
                             plan.block_ids[blk_off[i]:blk_off[i + 1]],
                             context.requests[rid].params, num_propose))
    return context.draft.step(seqs)


def _result(context: SpecContext, plan: StepPlan, sampled: list[int], items: list[VerifyInput],
            verified: list[Verified], proposals: dict[str, Proposal]) -> StepResult:
    ids = [plan.request_ids[i] for i in sampled]
    tokens = [t for v in verified for t in v.tokens]
    result = StepResult(step_id=plan.step_id, worker_id=context.worker_id, request_ids=ids,
                        num_sampled=np.asarray([len(v.tokens) for v in verified], np.int32),
                        sampled_token_ids=np.asarray(tokens, np.int32))
    fields: dict[str, Any] = {}
    if any(item.params.logprobs is not None for item in items):
        fields.update(_logprobs(items, verified, tokens))
    if proposals:
        fields.update(_proposal_fields(ids, proposals))
    if not fields:
        return result
    return dataclasses.replace(result, **fields)


def _logprobs(items: list[VerifyInput], verified: list[Verified],
              tokens: list[int]) -> dict[str, np.ndarray]:
    """Raw-model logprobs of each emitted token at the row it was sampled from."""
    raw = torch.cat([torch.log_softmax(item.logits[v.rows].float(), dim=-1)
                     for item, v in zip(items, verified)])
    rows = [SamplingRow(item.params, np.zeros(0, np.int64), 0, 0)
            for item, v in zip(items, verified) for _ in v.tokens]
    chosen, top_ids, top_values = logprob_columns(raw, torch.tensor(tokens, dtype=torch.int64), rows)
    return {"logprobs": chosen, "top_logprob_ids": top_ids, "top_logprobs": top_values}


def _proposal_fields(ids: list[str], proposals: dict[str, Proposal]) -> dict[str, np.ndarray]:
    trees = [proposals.get(rid, Proposal()) for rid in ids]
    is_tree = any(not is_chain(t.parents) for t in trees)
    return {
        "num_proposed": np.asarray([len(t.tokens) for t in trees], np.int32),
        "proposed_token_ids": np.asarray([x for t in trees for x in t.tokens], np.int32),
        "proposed_parents": (np.asarray([x for t in trees for x in t.parents], np.int32)
                             if is_tree else np.zeros(0, np.int32)),
    }
