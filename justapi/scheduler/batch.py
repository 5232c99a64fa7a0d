"""One step for one worker while it is being chosen: budgets, chunks, and the StepPlan.

Budgets (SchedulerConfig): max_seqs sequences, max_decode decoding and max_prefill
prefilling ones, chunk_size tokens per prefill chunk, max_batched_tokens in all.
The plan is columnar; block ids in it are relative to the worker's pool (global id -
BlockPool.base(pool)), i.e. the index of the block in that device's KV tensor:

    token_ids: | chunk 0 (prefill, chunk_size) | chunk 1 (decode: 1) | chunk 2 (1 + drafts) |
    block_ids: | table 0 ....... | table 1 ........ | table 2 ..... |

Owns: budget arithmetic and plan assembly. Does not own: who is chosen (planner.py).
"""
from __future__ import annotations

import array

import numpy as np

from justapi.config import SchedulerConfig
from justapi.protocol import NewRequest, StepPlan
from justapi.scheduler.request import Request
from justapi.scheduler.worker_state import ScheduledChunk


class StepBatch:
    """The chunks chosen so far for one worker's next step, and what budget is left."""

    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.budget_tokens = config.max_batched_tokens
        self.chunks: dict[str, ScheduledChunk] = {}
        self.num_prefill = 0
        self.num_decode = 0
        self.new_requests: dict[str, Request] = {}

    @property
    def has_decode_room(self) -> bool:
        return (self.num_decode < self.config.max_decode and len(self.chunks) < self.config.max_seqs
                and self.budget_tokens > 0)

    @property
    def has_prefill_room(self) -> bool:
        return (self.num_prefill < self.config.max_prefill
                and len(self.chunks) < self.config.max_seqs and self.budget_tokens > 0)

    def chunk_len(self, req: Request, is_prefill: bool) -> int:
        """How many of the tokens the request wants fit this step."""
        want = len(req.token_ids) + len(req.draft_token_ids) - req.num_computed_tokens
        if is_prefill:
            return min(want, self.config.chunk_size, self.budget_tokens)
        return min(want, self.budget_tokens)

    def add(self, req: Request, num_tokens: int, is_prefill: bool) -> None:
        start = req.num_computed_tokens
        known = len(req.token_ids) - start  # known tokens left; beyond them come drafts
        self.chunks[req.request_id] = ScheduledChunk(
            req, start, num_tokens, max(0, num_tokens - known), num_tokens >= known, is_prefill)
        self.budget_tokens -= num_tokens
        if is_prefill:
            self.num_prefill += 1
        else:
            self.num_decode += 1

    def remove(self, req: Request) -> None:
        """Un-schedule (the request is being preempted for an older one)."""
        chunk = self.chunks.pop(req.request_id)
        self.budget_tokens += chunk.num_tokens
        if chunk.is_prefill:
            self.num_prefill -= 1
        else:
            self.num_decode -= 1
        self.new_requests.pop(req.request_id, None)

    def build(self, step_id: int, pool_base: int, finished_request_ids: list[str]) -> StepPlan:
        token_ids = array.array("i")
        block_ids = array.array("i")
        starts, num_tokens, num_blocks, flags, drafts = [], [], [], [], []
        bs = self.block_size
        for chunk in self.chunks.values():
            req, start, n, d = chunk.req, chunk.start, chunk.num_tokens, chunk.num_drafts
            if n == 1:
                token_ids.append(req.token_ids[start])
            else:
                token_ids.extend(req.token_ids[start:start + n - d])
                if d:
                    token_ids.extend(array.array("i", req.draft_token_ids[:d]))
            table = req.block_ids
            needed = (start + n + bs - 1) // bs  # table[:needed] covers positions < start + n
            block_ids.extend(table if needed == len(table) else table[:needed])
            starts.append(start)
            num_tokens.append(n)
            num_blocks.append(needed)
            flags.append(chunk.is_sampled)
            drafts.append(d)
        blocks = np.frombuffer(block_ids, dtype=np.int32) if block_ids else _empty()
        if pool_base:
            blocks = blocks - np.int32(pool_base)
        return StepPlan(
            step_id=step_id, request_ids=list(self.chunks),
            start_positions=np.asarray(starts, dtype=np.int32),
            num_tokens=np.asarray(num_tokens, dtype=np.int32),
            token_ids=np.frombuffer(token_ids, dtype=np.int32) if token_ids else _empty(),
            num_blocks=np.asarray(num_blocks, dtype=np.int32), block_ids=blocks,
            sample_flags=np.asarray(flags, dtype=np.bool_),
            num_draft_tokens=np.asarray(drafts, dtype=np.int32) if any(drafts) else _empty(),
            new_requests=[_new_request(r) for r in self.new_requests.values()],
            finished_request_ids=finished_request_ids)


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


def _new_request(req: Request) -> NewRequest:
    return NewRequest(request_id=req.request_id, sampling=req.sampling,
                      num_prompt_tokens=req.num_prompt_tokens,
                      token_ids=np.array(req.token_ids, dtype=np.int32))
