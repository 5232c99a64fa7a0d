"""Modelled duration of one step, for capacity planning without a model:

    time_s = a + b * tokens_computed + c * context_reads

where context_reads sums, over every token computed, the positions it attends to (a chunk of
n tokens at start s reads n * s + n * (n + 1) / 2). Fit a, b, c from a
few measured steps of the real worker (`justapi bench serve`) to make the simulator predictive.
Owns: the formula. Does not own: measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from justapi.wire.protocol import StepPlan


@dataclass(frozen=True)
class StepCostModel:
    a_s: float = 0.004  # fixed cost per step (launch, sampling, IPC)
    b_s: float = 0.0002  # per token computed (weights pass)
    c_s: float = 0.000001  # per (token, attended position) read
    copy_a_s: float = 0.0005  # PD hand-off copy: fixed cost (the order and its ack)
    copy_b_s: float = 0.00002  # PD hand-off copy: per block

    def __post_init__(self) -> None:
        for name in ("a_s", "b_s", "c_s", "copy_a_s", "copy_b_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def step_time_s(self, plan: StepPlan) -> float:
        if plan.num_steps > 1:  # multi-step decoding: its steps back to back
            return sum(self.step_time_s(step) for step in plan.sub_steps())
        num_tokens = int(np.sum(plan.num_tokens))
        n = plan.num_tokens.astype(np.int64)
        context_reads = int(np.sum(n * plan.start_positions + n * (n + 1) // 2))
        return self.a_s + self.b_s * num_tokens + self.c_s * context_reads

    def copy_time_s(self, num_blocks: int) -> float:
        return self.copy_a_s + self.copy_b_s * num_blocks
