"""The in-process engine's one loop: the real scheduler core (justapi/scheduler/) drives a
ModelRunner as the server drives its workers - schedule -> execute -> update - over one
worker and one local pool, for plain and speculative decoding alike (the core owns budgets,
chunked prefill, the prefix cache, preemption, finish rules, drafts and their rollback).
Owns: that loop and collecting each request's tokens. Does not own: the core or the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.config.spec import SpecConfig
from justapi.sampling import SamplingParams
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.topology import ModelLimits, Topology
from justapi.wire.protocol import StepPlan, SubmitRequest, TokenDeltas, offsets
from workers.runner import ModelRunner

if TYPE_CHECKING:
    from justapi.scheduler.structured import StructuredOutputs

GRAMMAR_WAIT_S = 0.05


@dataclass(frozen=True)
class LoopLimits:
    """LLMEngine's settings, as the core takes them (one worker, one pool of num_blocks)."""

    num_blocks: int
    block_size: int
    max_seqs: int
    chunk_size: int
    max_batched_tokens: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    overlap: bool = False
    """Plan step N+1 before N's result (the server's overlap): in one process it saves
    nothing, but the runner resolves the placeholders just the same (tests)."""
    decode_steps: int = 1
    """Multi-step decoding's steps per plan (the server's --decode-steps; 1: off)."""
    long_rope_context: int = 0
    """LongRoPE's original context (ModelInfo.long_rope_context; 0: not LongRoPE)."""

    def build_core(self, spec: SpecConfig | None) -> Scheduler:
        """The core as justapi/scheduler/factory.py builds it for one mixed worker; no
        separate prefill cap (every seat may prefill in one step)."""
        config = SchedulerConfig(max_seqs=self.max_seqs, max_decode=self.max_seqs,
                                 max_prefill=self.max_seqs, chunk_size=self.chunk_size,
                                 max_batched_tokens=self.max_batched_tokens, overlap=self.overlap,
                                 decode_steps=self.decode_steps)
        return Scheduler(config, CacheConfig(self.block_size, self.num_blocks),
                         Topology.shared_pool(self.num_blocks),
                         ModelLimits(self.max_context, self.eos_token_ids,
                                     self.long_rope_context), spec)


@dataclass
class LoopOutput:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""


class SchedulerLoop:
    """One core, fresh per loop: its prefix cache and counters cover this loop's requests."""

    def __init__(self, runner: ModelRunner, limits: LoopLimits, spec: SpecConfig | None = None,
                 structured: StructuredOutputs | None = None) -> None:
        self.core = limits.build_core(spec)
        self.core.state.structured = structured  # grammars (None: constrained requests refused)
        self.runner = runner
        self.outputs: dict[str, LoopOutput] = {}
        self.num_steps = 0

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[LoopOutput]:
        """Every prompt to completion; outputs in prompt order. ValueError (the core's) for a
        prompt that can never run."""
        ids = [f"loop-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.core.add_request(SubmitRequest(rid, np.asarray(prompt, dtype=np.int32), p))
            self.outputs[rid] = LoopOutput()
        with torch.inference_mode():
            while self.core.has_work():  # finished requests' drops reach the runner too
                self.step()
        return [self.outputs.pop(rid) for rid in ids]

    def step(self) -> None:
        """The server's step: schedule, execute, update (waiting for a grammar's compile when
        nothing else can run)."""
        self._record(self.core.poll_grammars())
        plans = self.core.schedule()
        while not plans and self.core.state.structured is not None \
                and self.core.state.structured.pending:
            self._record(self.core.poll_grammars(timeout_s=GRAMMAR_WAIT_S))
            plans = self.core.schedule()
        if not plans:
            raise RuntimeError("unfinished requests but no plan: the scheduler is stuck")
        for _, plan in plans:
            assert isinstance(plan, StepPlan), "one worker, one pool: no KV copies"
            self._record(self.core.update(self.runner.execute(plan)))
            self.num_steps += 1

    def stats(self) -> dict[str, float]:
        return self.core.stats()

    def _record(self, deltas: TokenDeltas | None) -> None:
        if deltas is None:
            return
        off = offsets(deltas.num_new_tokens)
        for i, rid in enumerate(deltas.request_ids):
            out = self.outputs[rid]
            out.token_ids.extend(deltas.token_ids[off[i]:off[i + 1]].tolist())
            if deltas.finish_reasons[i]:
                out.finish_reason = deltas.finish_reasons[i]
                out.error = deltas.errors.get(rid, "")
