"""One step for one worker while it is being chosen: budgets, chunks, and the StepPlan.

Budgets (SchedulerConfig): max_seqs sequences, max_decode decoding and max_prefill
prefilling ones, chunk_size tokens per prefill chunk, max_batched_tokens in all; with decodes
in the step, prefill chunks also share a time allowance (limit_prefill, step_budget.py).
Chunks are kept as columns (one entry per sequence, plan order), like the plan itself.
Block ids in the plan are relative to the worker's pool (global id - BlockPool.base(pool)),
i.e. the index of the block in that device's KV tensor:

    token_ids: | chunk 0 (prefill, chunk_size) | chunk 1 (decode: 1) | chunk 2 (1 + drafts) |
    block_ids: | table 0 ....... | table 1 ........ | table 2 ..... |

Chunk i covers positions [starts[i], starts[i] + num_tokens[i]); its last num_drafts[i]
tokens are drafts (a chain, or the tree in req.draft_parents); is_sampled[i] when it reaches
the request's last known token; num_propose[i] draft-model tokens are asked for the next step,
and its block table then also covers positions up to starts[i] + num_tokens[i] + num_propose[i].
Owns: budget arithmetic and plan assembly. Does not own: who is chosen (planner.py).
"""
from __future__ import annotations

import array

import numpy as np

from justapi.config.sections import SchedulerConfig
from justapi.scheduler.faults import RequestFailures
from justapi.scheduler.request import Request
from justapi.scheduler.step_cost import StepCost, StepFeatures, context_reads
from justapi.wire.protocol import EXACT_CHUNK_TOKENS, PLACEHOLDER_TOKEN, NewRequest, StepPlan


class StepBatch:
    """The chunks chosen so far for one worker's next step, and what budget is left."""

    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.budget_tokens = config.max_batched_tokens
        self.reqs: list[Request] = []
        self.starts: list[int] = []
        self.num_tokens: list[int] = []
        self.num_drafts: list[int] = []
        self.is_sampled: list[bool] = []
        self.is_prefill: list[bool] = []
        self.num_blocks: list[int] = []  # table[:num_blocks] covers positions < start + n (+ propose)
        self.num_propose: list[int] = []  # draft-model look-ahead (speculation.py)
        self.num_prefill = 0
        self.num_decode = 0
        self.new_requests: dict[str, Request] = {}
        self.unseen_request_ids: set[str] = set()  # admitted here, the worker has no state of
        self.cost: StepCost | None = None  # set with a prefill allowance (limit_prefill)
        self.prefill_allowance_s = 0.0

    def __len__(self) -> int:
        return len(self.reqs)

    def __contains__(self, req: Request) -> bool:
        return any(r is req for r in self.reqs)

    @property
    def has_decode_room(self) -> bool:
        return (self.num_decode < self.config.max_decode and len(self.reqs) < self.config.max_seqs
                and self.budget_tokens > 0)

    @property
    def has_prefill_room(self) -> bool:
        return (self.num_prefill < self.config.max_prefill
                and len(self.reqs) < self.config.max_seqs and self.budget_tokens > 0
                and (self.cost is None or self.prefill_allowance_s > 0))

    def limit_prefill(self, cost: StepCost, allowance_s: float) -> None:
        """From now on prefill chunks share allowance_s seconds of the step (as `cost` prices
        them); the first chunk gets at least one token."""
        self.cost = cost
        self.prefill_allowance_s = allowance_s

    def chunk_len(self, req: Request, is_prefill: bool) -> int:
        """How many of the tokens the request wants fit this step."""
        want = len(req.token_ids) + len(req.draft_token_ids) - req.num_computed_tokens
        if not is_prefill:
            return min(want, self.budget_tokens)
        num_tokens = min(want, self.config.chunk_size, self.budget_tokens, _exact_chunk(req))
        if self.cost is not None:
            within = self.cost.tokens_within(self.prefill_allowance_s, req.num_computed_tokens)
            num_tokens = min(num_tokens, max(1, within))
        return num_tokens

    def features(self, decodes_only: bool = False) -> StepFeatures:
        """The step (or its decodes) in the cost formula's terms (step_cost.py)."""
        prefill = decode = reads = 0
        for start, n, is_prefill in zip(self.starts, self.num_tokens, self.is_prefill):
            if is_prefill and decodes_only:
                continue
            if is_prefill:
                prefill += n
            else:
                decode += n
            reads += context_reads(start, n)
        return StepFeatures(prefill, decode, reads)

    def add(self, req: Request, num_tokens: int, is_prefill: bool) -> None:
        start = req.num_computed_tokens
        known = len(req.token_ids) - start  # known tokens left; beyond them come drafts
        self.reqs.append(req)
        self.starts.append(start)
        self.num_tokens.append(num_tokens)
        self.num_drafts.append(max(0, num_tokens - known))
        self.is_sampled.append(num_tokens >= known and not req.pooling)
        self.is_prefill.append(is_prefill)
        self.num_blocks.append((start + num_tokens + self.block_size - 1) // self.block_size)
        self.num_propose.append(0)
        self.budget_tokens -= num_tokens
        if is_prefill:
            self.num_prefill += _is_prompt_chunk(req, start)
            if self.cost is not None:
                self.prefill_allowance_s -= self.cost.chunk_s(start, num_tokens)
        else:
            self.num_decode += 1

    def add_decode(self, req: Request, num_tokens: int) -> None:
        """add() for a decoding request (one known token, then drafts): the hot path."""
        start = req.num_computed_tokens
        # one known token, or (overlap) none yet: the placeholder of the step in flight
        assert 0 <= len(req.token_ids) - start <= 1, f"{req.request_id}: not one token to decode"
        self.reqs.append(req)
        self.starts.append(start)
        self.num_tokens.append(num_tokens)
        self.num_drafts.append(num_tokens - 1)
        self.is_sampled.append(True)
        self.is_prefill.append(False)
        self.num_blocks.append((start + num_tokens + self.block_size - 1) // self.block_size)
        self.num_propose.append(0)
        self.budget_tokens -= num_tokens
        self.num_decode += 1

    def set_propose(self, num_propose: int) -> None:
        """The last chunk asks the draft model for num_propose tokens; its table grows to the
        look-ahead positions (the caller holds blocks for them)."""
        end = self.starts[-1] + self.num_tokens[-1] + num_propose
        self.num_propose[-1] = num_propose
        self.num_blocks[-1] = (end + self.block_size - 1) // self.block_size

    def remove(self, req: Request) -> None:
        """Un-schedule (the request is being preempted for an older one). O(batch): rare."""
        i = next(i for i, r in enumerate(self.reqs) if r is req)
        self.budget_tokens += self.num_tokens[i]
        if self.is_prefill[i]:
            self.num_prefill -= _is_prompt_chunk(req, self.starts[i])
            if self.cost is not None:
                self.prefill_allowance_s += self.cost.chunk_s(self.starts[i], self.num_tokens[i])
        else:
            self.num_decode -= 1
        for column in (self.reqs, self.starts, self.num_tokens, self.num_drafts, self.is_sampled,
                       self.is_prefill, self.num_blocks, self.num_propose):
            del column[i]
        self.new_requests.pop(req.request_id, None)

    def build(self, step_id: int, pool_base: int, finished_request_ids: list[str],
              num_steps: int = 1) -> StepPlan:
        """The plan; num_steps > 1 (a batch of single-token decodes only): a multi-step plan,
        each table covering the positions of all its steps."""
        token_ids = array.array("i")
        block_ids = array.array("i")
        num_blocks = self.num_blocks
        has_gap = False
        if num_steps > 1:
            bs = self.block_size
            num_blocks = [(start + num_steps + bs - 1) // bs for start in self.starts]
        for req, start, n, d, needed in zip(self.reqs, self.starts, self.num_tokens,
                                            self.num_drafts, num_blocks):
            if n == 1:  # a decode
                if start < len(req.token_ids):
                    token_ids.append(req.token_ids[start])
                else:  # past the known tokens: the token a step in flight samples (overlap)
                    token_ids.append(PLACEHOLDER_TOKEN)
                    has_gap = has_gap or start > len(req.token_ids)  # (not that token: a bug)
            else:
                token_ids.extend(req.token_ids[start:start + n - d])
                if d:
                    token_ids.extend(array.array("i", req.draft_token_ids[:d]))
            table = req.block_ids
            block_ids.extend(table if needed == len(table) else table[:needed])
        if has_gap or len(token_ids) != sum(self.num_tokens) or len(block_ids) != sum(num_blocks):
            misfits = self._misfits(num_blocks)
            if not misfits:
                raise ValueError(f"step {step_id}: the chunks' columns disagree")
            raise RequestFailures("plan", misfits)
        blocks = np.frombuffer(block_ids, dtype=np.int32) if block_ids else _empty()
        if pool_base:
            blocks = blocks - np.int32(pool_base)
        return StepPlan(
            step_id=step_id, request_ids=[req.request_id for req in self.reqs],
            start_positions=np.asarray(self.starts, dtype=np.int32),
            num_tokens=np.asarray(self.num_tokens, dtype=np.int32),
            token_ids=np.frombuffer(token_ids, dtype=np.int32) if token_ids else _empty(),
            num_blocks=np.asarray(num_blocks, dtype=np.int32), block_ids=blocks,
            sample_flags=np.asarray(self.is_sampled, dtype=np.bool_),
            num_draft_tokens=(np.asarray(self.num_drafts, dtype=np.int32) if any(self.num_drafts)
                              else _empty()),
            new_requests=[_new_request(r) for r in self.new_requests.values()],
            finished_request_ids=finished_request_ids,
            draft_parents=self._draft_parents(),
            num_propose=(np.asarray(self.num_propose, dtype=np.int32) if any(self.num_propose)
                         else _empty()),
            num_steps=num_steps)

    def _misfits(self, num_blocks: list[int]) -> list[tuple[Request, Exception]]:
        """The chunks that do not match their request's tokens, drafts or blocks (a bug; each
        fails its request alone, faults.py)."""
        out: list[tuple[Request, Exception]] = []
        for req, start, n, d, needed in zip(self.reqs, self.starts, self.num_tokens,
                                            self.num_drafts, num_blocks):
            known = len(req.token_ids) - start
            is_placeholder = n == 1 and known == 0  # overlap: the token a step in flight samples
            if not (start >= 0 and n >= 1 and 0 <= d <= len(req.draft_token_ids)
                    and needed <= len(req.block_ids) and (n - d <= known or is_placeholder)):
                out.append((req, ValueError(
                    f"a chunk of {n} tokens ({d} drafts) at position {start} does not match the "
                    f"request: {len(req.token_ids)} tokens, {len(req.draft_token_ids)} drafts, "
                    f"{len(req.block_ids)} blocks for the {needed} the chunk needs")))
        return out

    def _draft_parents(self) -> np.ndarray:
        """Flat draft parents when some sequence's drafts are a tree; [] when all are chains."""
        if not any(req.draft_parents for req, d in zip(self.reqs, self.num_drafts) if d):
            return _empty()
        out: list[int] = []
        for req, d in zip(self.reqs, self.num_drafts):
            out.extend(req.draft_parents[:d] if req.draft_parents else range(-1, d - 1))
        return np.asarray(out, dtype=np.int32)


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


def _new_request(req: Request) -> NewRequest:
    return NewRequest(request_id=req.request_id, sampling=req.sampling,
                      num_prompt_tokens=req.num_prompt_tokens,
                      token_ids=np.array(req.token_ids, dtype=np.int32), pooling=req.pooling)


def _exact_chunk(req: Request) -> int:
    """Most tokens of a prefill chunk that starts where `req` stands: up to its prompt's end,
    then EXACT_CHUNK_TOKENS over the tokens it already sampled (a resubmission, a recompute
    after preemption), which then come out with the bits decoding gave them."""
    if req.num_computed_tokens < req.num_prompt_tokens:
        return req.num_prompt_tokens - req.num_computed_tokens
    return EXACT_CHUNK_TOKENS


def _is_prompt_chunk(req: Request, start: int) -> int:
    """1 for a chunk of the prompt; 0 for one recomputing sampled tokens, which is short like a
    decode and does not take one of max_prefill's places (32 requests resubmitted at once
    replay side by side, not four at a time)."""
    return int(start < req.num_prompt_tokens)
