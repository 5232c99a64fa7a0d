"""The in-process engine driven by the real scheduler core (justapi/scheduler/), as the server
drives its workers: schedule -> ModelRunner.execute -> update, one worker, one local pool.

LLMEngine uses it when speculative decoding is on (the core owns drafts, budgets, look-ahead
blocks and rollback); plain decoding keeps the small BatchPolicy loop.
Owns: that loop and collecting each request's tokens. Does not own: the core or the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.config.spec import SpecConfig
from justapi.sampling import SamplingParams
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.topology import ModelLimits, Topology
from justapi.wire.protocol import SubmitRequest, TokenDeltas, offsets
from workers.runner import ModelRunner


@dataclass
class LoopLimits:
    """What the engine's loop needs from LLMEngine's settings."""

    num_blocks: int
    block_size: int
    max_seqs: int
    chunk_size: int
    max_batched_tokens: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class LoopOutput:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""


class SchedulerLoop:
    def __init__(self, runner: ModelRunner, limits: LoopLimits, spec: SpecConfig) -> None:
        config = SchedulerConfig(max_seqs=limits.max_seqs, max_decode=limits.max_seqs,
                                 max_prefill=limits.max_seqs, chunk_size=limits.chunk_size,
                                 max_batched_tokens=limits.max_batched_tokens)
        self.core = Scheduler(config, CacheConfig(limits.block_size, limits.num_blocks),
                              Topology.shared_pool(limits.num_blocks),
                              ModelLimits(limits.max_context, limits.eos_token_ids), spec)
        self.runner = runner
        self.num_steps = 0

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[LoopOutput]:
        """Every prompt to completion; outputs in prompt order."""
        ids = [f"loop-{i}" for i in range(len(prompts))]
        outputs = {rid: LoopOutput() for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params):
            self.core.add_request(SubmitRequest(rid, np.asarray(prompt, dtype=np.int32), p))
        while self.core.has_work():
            plans = self.core.schedule()
            if not plans:
                raise RuntimeError("unfinished requests but no plan: the scheduler is stuck")
            for _, plan in plans:
                assert not hasattr(plan, "copy_id"), "one worker, one pool: no KV copies"
                self._record(self.core.update(self.runner.execute(plan)), outputs)  # type: ignore[arg-type]
                self.num_steps += 1
        return [outputs[rid] for rid in ids]

    def stats(self) -> dict[str, float]:
        return self.core.stats()

    @staticmethod
    def _record(deltas: TokenDeltas, outputs: dict[str, LoopOutput]) -> None:
        off = offsets(deltas.num_new_tokens)
        for i, rid in enumerate(deltas.request_ids):
            out = outputs[rid]
            out.token_ids.extend(deltas.token_ids[off[i]:off[i + 1]].tolist())
            if deltas.finish_reasons[i]:
                out.finish_reason = deltas.finish_reasons[i]
                out.error = deltas.errors.get(rid, "")
