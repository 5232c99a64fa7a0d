"""The in-process engine's batching policy: small, and meant to be replaced by the real scheduler.

One rule (vLLM v1's): every running sequence wants len(token_ids) - num_computed more tokens;
each step gives it min(that, chunk_size, token budget left). Running sequences go first, then
waiting ones are admitted while seats (max_seqs), budget and free blocks allow. When blocks
run out the newest running sequence is preempted: its blocks are freed, its tokens kept, and it
is re-queued to be recomputed. Sampling happens when a chunk reaches the last known token.
Owns: sequences' progress, block tables and finish rules. Does not own: any tensor.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from justapi.sampling import SamplingParams
from justapi.wire.protocol import FINISH_LENGTH, FINISH_STOP, NewRequest, StepPlan, StepResult

Chunk = tuple[str, int, list[int], list[int], bool]
"""(request_id, start position, token ids, block ids, sample?) as StepPlan.build takes it."""


@dataclass
class Sequence:
    request_id: str
    params: SamplingParams
    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int
    max_context: int
    eos_token_ids: frozenset[int] = frozenset()
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    is_announced: bool = False
    finish_reason: str = ""

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def check_finish(self) -> str:
        """After a token was appended: "", or the reason to stop."""
        last = self.token_ids[-1]
        if last in self.params.stop_token_ids:
            return FINISH_STOP
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return FINISH_STOP
        if len(self.output_ids) >= self.params.max_tokens or len(self.token_ids) >= self.max_context:
            return FINISH_LENGTH  # the context is full: the last token cannot be computed
        return ""


class BatchPolicy:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, chunk_size: int,
                 max_batched_tokens: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_seqs = max_seqs
        self.chunk_size = chunk_size
        self.max_batched_tokens = max_batched_tokens
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished_ids: list[str] = []
        self.num_preemptions = 0
        self._step_id = 0

    def add(self, seq: Sequence) -> None:
        longest = min(len(seq.token_ids) + seq.params.max_tokens, seq.max_context)
        if self._blocks_for(longest) > self.num_blocks:
            raise ValueError(f"request {seq.request_id} may need {self._blocks_for(longest)} KV blocks, "
                             f"the pool has {self.num_blocks}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.max_batched_tokens
        chunks: list[Chunk] = []
        new_requests: list[NewRequest] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted while making room for an older one
                continue
            num = min(len(seq.token_ids) - seq.num_computed, self.chunk_size, budget)
            if num > 0 and self._make_room(seq, seq.num_computed + num):
                budget -= num
                chunks.append(self._chunk(seq, num, new_requests))
        while self.waiting and len(self.running) < self.max_seqs and budget > 0:
            seq = self.waiting[0]
            num = min(len(seq.token_ids) - seq.num_computed, self.chunk_size, budget)
            if not self._reserve(seq, seq.num_computed + num):
                break
            self.running.append(self.waiting.popleft())
            budget -= num
            chunks.append(self._chunk(seq, num, new_requests))
        if not chunks:
            raise RuntimeError("no sequence could be scheduled (KV pool too small?)")
        self._step_id += 1
        finished, self.finished_ids = self.finished_ids, []
        return StepPlan.build(self._step_id, chunks, new_requests, finished)

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Advance computed counts, append sampled tokens; return the sequences that finished."""
        by_id = {s.request_id: s for s in self.running}
        for request_id, num in zip(plan.request_ids, plan.num_tokens):
            by_id[request_id].num_computed += int(num)
        done = []
        for request_id, token in zip(result.request_ids, result.sampled_token_ids):
            seq = by_id[request_id]
            seq.token_ids.append(int(token))
            seq.finish_reason = seq.check_finish()
            if seq.finish_reason:
                done.append(seq)
                self._release(seq)
                self.running.remove(seq)
                self.finished_ids.append(seq.request_id)
        return done

    # ------------------------------------------------------------------ internals

    def _chunk(self, seq: Sequence, num: int, new_requests: list[NewRequest]) -> Chunk:
        if not seq.is_announced:
            new_requests.append(NewRequest(seq.request_id, seq.params, seq.num_prompt_tokens,
                                           np.asarray(seq.token_ids, dtype=np.int32)))
            seq.is_announced = True
        start = seq.num_computed
        is_last = start + num == len(seq.token_ids)
        return (seq.request_id, start, seq.token_ids[start:start + num], list(seq.block_ids), is_last)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = self._blocks_for(num_tokens) - len(seq.block_ids)
        if need > len(self.free_blocks):
            return False
        seq.block_ids.extend(self.free_blocks.pop() for _ in range(max(need, 0)))
        return True

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Reserve blocks for seq, preempting the newest running sequences as needed."""
        while not self._reserve(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._release(seq)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.is_announced = False  # the runner relearns it (NewRequest replaces its state)
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.block_ids))
        seq.block_ids = []
