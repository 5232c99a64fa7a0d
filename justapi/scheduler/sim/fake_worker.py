"""A worker stand-in that executes StepPlans against a FakeKvStore and checks them.

It keeps the token history the plans taught it (NewRequest, then its own samples, then tokens
a chunk adds after them: a grammar's forced tokens), and for each chunk checks: it knows the
request; the chunk's tokens are the request's tokens at the positions it knows; the block table has exactly the blocks the positions need, all inside the
pool; the entry before the chunk reads back with the right position. It then writes the
chunk's KV entries and, for sampled chunks, reads every position back through the table
(positions must match) to compute the next token - verifying drafts greedily (accepted
drafts, then one corrected/bonus token; a token tree is walked from its root, the accepted
path written at the positions of its tokens, as the real worker moves its KV). A `proposer`
stands in for a draft model: asked for num_propose tokens, it returns a token tree that goes
back in the StepResult. A structured output's token bitmask narrows the pick at its rows to
the allowed ids (fake_model.next_token). PD copy orders copy slots between stores. A
PLACEHOLDER_TOKEN (overlap) must name a position whose token this worker sampled. LongRoPE (a
`long_rope_context`): an entry takes the long table as the real worker picks it
(workers/model/rotary.py: its request was announced longer than that context, or its position
is past it). Any violation raises FakeWorkerError.
Owns: the fake worker's request memory. Does not own: the model function (fake_model).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from justapi.scheduler.sim.fake_model import (
    SEED_HASH,
    FakeKvStore,
    allowed_ids,
    mix_row,
    next_token,
    pooled_state,
)
from justapi.wire.protocol import (
    PLACEHOLDER_TOKEN,
    BlocksCopied,
    CopyBlocks,
    StepPlan,
    StepResult,
    merge_step_results,
    offsets,
)


class FakeWorkerError(AssertionError):
    """A plan that a real worker would have executed wrongly."""


@dataclass(frozen=True)
class Chunk:
    """One sequence of a plan: tokens at positions [start, start + len(tokens)), the last
    num_drafts of them drafts, and its block table."""

    request_id: str
    start: int
    tokens: np.ndarray  # int64 [num_tokens]
    num_drafts: int
    table: np.ndarray  # int32 [num_blocks]
    parents: list[int] | None = None  # the drafts' tree; None = a chain
    num_propose: int = 0
    first_row: int = 0  # logits row of its last known token (then one per draft)


Proposer = Callable[[str, list[int], int], tuple[list[int], list[int]]]
"""(request id, its known tokens, how many to propose) -> (tokens, parents) of a token tree."""


class FakeWorker:
    def __init__(self, worker_id: int, store: FakeKvStore, vocab_size: int,
                 proposer: Proposer | None = None, long_rope_context: int = 0) -> None:
        self.worker_id = worker_id
        self.store = store
        self.vocab_size = vocab_size
        self.proposer = proposer
        self.long_rope_context = long_rope_context  # 0: no LongRoPE
        self.requests: dict[str, list[int]] = {}  # request id -> tokens known to this worker
        self.num_announced: dict[str, int] = {}  # request id -> tokens its NewRequest had
        self.wants_logprobs: dict[str, bool] = {}
        self.pooling: dict[str, list] = {}  # pooling request -> [pooling, prompt length, computed]
        self.num_steps = 0
        self.num_copies = 0
        self._masks: dict[int, np.ndarray] = {}  # this step's bitmask rows by logits row
        self._steps_after = 0  # a multi-step plan's steps after the one running

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.num_steps > 1:  # multi-step decoding, as workers/runner.py runs it
            results = []
            for j, step in enumerate(plan.sub_steps()):
                self._steps_after = plan.num_steps - 1 - j  # the tables cover those positions too
                results.append(self.execute(step))
            self._steps_after = 0
            return merge_step_results(results)
        self.num_steps += 1
        for rid in plan.finished_request_ids:
            if rid not in self.requests:
                raise FakeWorkerError(f"step {plan.step_id}: drop of unknown request {rid!r}")
            del self.requests[rid]
            del self.wants_logprobs[rid]
            self.pooling.pop(rid, None)
            self.num_announced.pop(rid, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = [int(t) for t in new.token_ids]
            self.num_announced[new.request_id] = len(new.token_ids)
            self.wants_logprobs[new.request_id] = new.sampling.logprobs is not None
            self.pooling.pop(new.request_id, None)
            if new.pooling:
                self.pooling[new.request_id] = [new.pooling, new.num_prompt_tokens, 0]
        tok_off, blk_off = offsets(plan.num_tokens), offsets(plan.num_blocks)
        drafts, propose = plan.draft_counts, plan.propose_counts
        sampled_ids, counts, tokens = [], [], []
        pooled_ids: list[str] = []
        pooled: list[np.ndarray] = []
        proposals: list[tuple[list[int], list[int]]] = []
        self._masks = {int(row): m for row, m in zip(plan.bitmask_rows, plan.token_bitmask)}
        logits_row = 0  # the chunk's first logits row (StepPlan.bitmask_rows counts them)
        for i, rid in enumerate(plan.request_ids):
            parents = plan.parents_of(i).tolist() if len(plan.draft_parents) and drafts[i] else None
            start = int(plan.start_positions[i])
            chunk_tokens = self._resolve(plan.step_id, rid, start,
                                         plan.token_ids[tok_off[i]:tok_off[i + 1]].astype(np.int64))
            chunk = Chunk(rid, start, chunk_tokens, int(drafts[i]),
                          plan.block_ids[blk_off[i]:blk_off[i + 1]], parents, int(propose[i]), logits_row)
            self._check_chunk(plan.step_id, chunk)
            if parents is None:
                self._write(chunk.start, chunk.tokens, chunk.table, rid)
            if rid in self.pooling:
                state = self._pool(plan.step_id, chunk, bool(plan.sample_flags[i]))
                if state is not None:
                    pooled_ids.append(rid)
                    pooled.append(state)
            if plan.sample_flags[i]:
                logits_row += 1 + int(drafts[i])
                out = self._sample(chunk) if parents is None else self._sample_tree(chunk)
                self.requests[rid].extend(out)
                sampled_ids.append(rid)
                counts.append(len(out))
                tokens.extend(out)
                proposals.append(self._propose(chunk))
        result = self._result(plan.step_id, sampled_ids, counts, tokens)
        if pooled_ids:
            result = dataclasses.replace(result, pooled_request_ids=pooled_ids,
                                         pooled_states=np.stack(pooled))
        return _with_proposals(result, proposals) if any(p[0] for p in proposals) else result

    def _pool(self, step_id: int, c: Chunk, is_sampled: bool) -> np.ndarray | None:
        """A pooling request's chunk: never sampled; the one ending its prompt returns the
        pooled state. A mean/cls one must have computed every position itself (no cache hit)."""
        pooling, num_prompt, computed = self.pooling[c.request_id]
        if is_sampled or c.num_drafts or c.start + len(c.tokens) > num_prompt:
            raise FakeWorkerError(f"step {step_id}: pooling request {c.request_id!r} sampled "
                                  "or past its prompt")
        if pooling != "last" and c.start != computed:
            raise FakeWorkerError(f"step {step_id}: {pooling} pooling of {c.request_id!r} "
                                  f"skips positions [{computed}, {c.start})")
        self.pooling[c.request_id][2] = c.start + len(c.tokens)
        if c.start + len(c.tokens) < num_prompt:
            return None
        _, hashes = self._read_back(c.table, num_prompt - 1)
        return pooled_state(int(hashes[-1]))

    def _resolve(self, step_id: int, rid: str, start: int, tokens: np.ndarray) -> np.ndarray:
        """Placeholders -> the tokens this worker sampled at those positions."""
        holes = np.flatnonzero(tokens == PLACEHOLDER_TOKEN)
        known = self.requests.get(rid, [])
        for hole in holes.tolist():
            if start + hole >= len(known):
                raise FakeWorkerError(f"step {step_id}: {rid!r} placeholder at position "
                                      f"{start + hole} names no sampled token")
            tokens[hole] = known[start + hole]
        return tokens

    def _check_chunk(self, step_id: int, c: Chunk) -> None:
        rid, start, chunk, num_drafts, table = c.request_id, c.start, c.tokens, c.num_drafts, c.table
        known = self.requests.get(rid)
        if known is None:
            raise FakeWorkerError(f"step {step_id}: no state for {rid!r} (missing NewRequest)")
        num_known = len(chunk) - num_drafts
        overlap = known[start:start + num_known]
        if start > len(known) or list(chunk[:len(overlap)]) != overlap:
            raise FakeWorkerError(f"step {step_id}: {rid!r} chunk at {start} is not its tokens")
        known.extend(int(t) for t in chunk[len(overlap):num_known])  # forced by a grammar
        bs = self.store.block_size
        needed = -(-(start + len(chunk) + c.num_propose + self._steps_after) // bs)
        if len(table) != needed:
            raise FakeWorkerError(f"step {step_id}: {rid!r} has {len(table)} blocks, needs {needed}")
        if len(table) and (int(table.min()) < 0 or int(table.max()) >= self.store.num_blocks):
            raise FakeWorkerError(f"step {step_id}: {rid!r} block id outside the pool")
        if len(set(table.tolist())) != len(table):
            raise FakeWorkerError(f"step {step_id}: {rid!r} lists a block twice")
        if start > 0:
            self._read_back(table, start - 1)

    def _read_back(self, table: np.ndarray, last: int) -> tuple[np.ndarray, np.ndarray]:
        """Entries of positions [0, last] through the table; their positions must match."""
        store = self.store
        slots = store.slots(table, 0, last + 1)
        if not np.array_equal(store.positions[slots], np.arange(last + 1)):
            bad = int(np.argmax(store.positions[slots] != np.arange(last + 1)))
            raise FakeWorkerError(f"position {bad} reads slot {int(slots[bad])} holding position "
                                  f"{int(store.positions[slots[bad]])}")
        return store.tokens[slots], store.hashes[slots]

    def _write(self, start: int, chunk: np.ndarray, table: np.ndarray, request_id: str) -> None:
        store = self.store
        slots = store.slots(table, start, start + len(chunk))
        h = int(store.hashes[store.slots(table, start - 1, start)[0]]) if start else SEED_HASH
        original = self.long_rope_context
        is_long = 0 < original < self.num_announced.get(request_id, 0)
        for j, token in enumerate(chunk.tolist()):
            h = mix_row(h, token, start + j, is_long or 0 < original < start + j + 1)
            slot = int(slots[j])
            store.tokens[slot] = token
            store.positions[slot] = start + j
            store.hashes[slot] = h
        store.num_writes += len(chunk)

    def _sample(self, c: Chunk) -> list[int]:
        start, chunk, num_drafts, table = c.start, c.tokens, c.num_drafts, c.table
        last_known = start + len(chunk) - num_drafts - 1
        out: list[int] = []
        for j in range(num_drafts + 1):
            tokens, hashes = self._read_back(table, last_known + j)
            token = next_token(tokens, hashes, self.vocab_size, self._allowed(c.first_row + j))
            out.append(token)
            if j == num_drafts or token != int(chunk[len(chunk) - num_drafts + j]):
                break
        return out

    def _sample_tree(self, c: Chunk) -> list[int]:
        """Greedy verification of a token tree: from the root (the last known token) follow
        the child whose token the model predicts, writing each accepted token at its
        position; the first prediction no child has is the bonus token."""
        assert c.parents is not None
        num_known = len(c.tokens) - c.num_drafts
        self._write(c.start, c.tokens[:num_known], c.table, c.request_id)
        drafts = c.tokens[num_known:].tolist()
        node, last = -1, c.start + num_known - 1
        out: list[int] = []
        while True:
            tokens, hashes = self._read_back(c.table, last)
            token = next_token(tokens, hashes, self.vocab_size, self._allowed(c.first_row + 1 + node))
            out.append(token)
            child = next((j for j, p in enumerate(c.parents)
                          if p == node and drafts[j] == token), None)
            if child is None:
                return out
            last += 1
            self._write(last, np.asarray([token], dtype=np.int64), c.table, c.request_id)
            node = child

    def _allowed(self, logits_row: int) -> np.ndarray | None:
        """The token ids a structured output's mask allows at that row (None: free)."""
        mask = self._masks.get(logits_row)
        return None if mask is None else allowed_ids(mask, self.vocab_size)

    def _propose(self, c: Chunk) -> tuple[list[int], list[int]]:
        if not c.num_propose or self.proposer is None:
            return [], []
        return self.proposer(c.request_id, list(self.requests[c.request_id]), c.num_propose)

    def copy_blocks(self, order: CopyBlocks, src_store: FakeKvStore) -> BlocksCopied:
        """A PD hand-off copy: every slot of the listed blocks, src_store -> this worker's store."""
        src_ids = order.src_block_ids.astype(np.int64)
        dst_ids = order.dst_block_ids.astype(np.int64)
        for ids, store, what in ((src_ids, src_store, "source"), (dst_ids, self.store, "destination")):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= store.num_blocks):
                raise FakeWorkerError(f"copy {order.copy_id}: {what} block outside its pool")
        if len(set(dst_ids.tolist())) != len(dst_ids):
            raise FakeWorkerError(f"copy {order.copy_id}: a destination block is listed twice")
        bs = self.store.block_size
        src_slots = (src_ids[:, None] * bs + np.arange(bs)).reshape(-1)
        dst_slots = (dst_ids[:, None] * bs + np.arange(bs)).reshape(-1)
        for name in ("tokens", "positions", "hashes"):
            getattr(self.store, name)[dst_slots] = getattr(src_store, name)[src_slots]
        self.num_copies += 1
        return BlocksCopied(order.copy_id, self.worker_id, len(dst_ids))

    def _result(self, step_id: int, request_ids: list[str], counts: list[int],
                tokens: list[int]) -> StepResult:
        wants = any(self.wants_logprobs.get(rid, False) for rid in request_ids)
        token_arr = np.asarray(tokens, dtype=np.int32)
        result = StepResult(step_id=step_id, worker_id=self.worker_id, request_ids=request_ids,
                            num_sampled=np.asarray(counts, dtype=np.int32),
                            sampled_token_ids=token_arr)
        if not wants:
            return result
        return dataclasses.replace(  # fake logprobs derived from the token, top-2 alternatives
            result, logprobs=-(token_arr % 7).astype(np.float32) - 0.5,
            top_logprob_ids=np.stack([token_arr, token_arr + 1], axis=1),
            top_logprobs=np.zeros((len(tokens), 2), dtype=np.float32))


def _with_proposals(result: StepResult, proposals: list[tuple[list[int], list[int]]]) -> StepResult:
    is_tree = any(parents != list(range(-1, len(tokens) - 1)) for tokens, parents in proposals)
    return dataclasses.replace(
        result, num_proposed=np.asarray([len(t) for t, _ in proposals], dtype=np.int32),
        proposed_token_ids=np.asarray([x for t, _ in proposals for x in t], dtype=np.int32),
        proposed_parents=(np.asarray([x for _, p in proposals for x in p], dtype=np.int32)
                          if is_tree else np.zeros(0, dtype=np.int32)))
