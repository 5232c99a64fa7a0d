"""What a simulation records: per request (times and steps of its milestones, its output),
per plan (optional), per step (occupancy), and summaries of them.

Owns: the record types and their derived figures. Does not own: the event loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from justapi.sampling import SamplingParams
from justapi.wire.protocol import StepPlan


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    arrival_step: int
    prompt: list[int]
    sampling: SamplingParams
    output: list[int] = field(default_factory=list)
    first_scheduled_s: float | None = None
    first_scheduled_step: int | None = None
    first_token_s: float | None = None
    first_token_step: int | None = None
    finish_s: float | None = None
    finish_step: int | None = None
    finish_reason: str = ""
    error: str = ""
    num_cached_tokens: int = 0
    token_times_s: list[float] = field(default_factory=list)  # one per delta that had tokens

    def scheduled(self, now_s: float, step: int) -> None:
        if self.first_scheduled_s is None:
            self.first_scheduled_s, self.first_scheduled_step = now_s, step

    def add_tokens(self, tokens: list[int], now_s: float, step: int) -> None:
        if tokens and self.first_token_s is None:
            self.first_token_s, self.first_token_step = now_s, step
        if tokens:
            self.token_times_s.append(now_s)
        self.output.extend(tokens)

    def finish(self, now_s: float, step: int, reason: str, error: str = "") -> None:
        assert not self.finish_reason, f"{self.request_id} finished twice"
        self.finish_s, self.finish_step, self.finish_reason, self.error = now_s, step, reason, error

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def queue_steps(self) -> int | None:
        return None if self.first_scheduled_step is None else self.first_scheduled_step - self.arrival_step

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def ttft_steps(self) -> int | None:
        return None if self.first_token_step is None else self.first_token_step - self.arrival_step

    @property
    def itl_s(self) -> list[float]:
        """Gaps between the deltas that brought tokens (what a streaming client sees)."""
        times = self.token_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.finish_s is None or len(self.output) < 2:
            return None
        return (self.finish_s - self.first_token_s) / (len(self.output) - 1)

    @property
    def tpot_steps(self) -> float | None:
        if self.first_token_step is None or self.finish_step is None or len(self.output) < 2:
            return None
        return (self.finish_step - self.first_token_step) / (len(self.output) - 1)


@dataclass(frozen=True)
class PlanRecord:
    worker_id: int
    step_id: int
    time_s: float
    request_ids: tuple[str, ...]
    new_request_ids: tuple[str, ...]
    finished_request_ids: tuple[str, ...]
    num_tokens: int

    @classmethod
    def of(cls, worker_id: int, plan: StepPlan, time_s: float) -> PlanRecord:
        return cls(worker_id, plan.step_id, time_s, tuple(plan.request_ids),
                   tuple(n.request_id for n in plan.new_requests),
                   tuple(plan.finished_request_ids), int(np.sum(plan.num_tokens)))


@dataclass
class SimResult:
    records: dict[str, RequestRecord] = field(default_factory=dict)
    plans: list[PlanRecord] = field(default_factory=list)
    step_seqs: list[int] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    num_steps: int = 0
    duration_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    def outputs(self) -> dict[str, list[int]]:
        return {rid: r.output for rid, r in self.records.items()}

    def finish_reasons(self) -> dict[str, str]:
        return {rid: r.finish_reason for rid, r in self.records.items()}

    def percentiles(self, name: str, qs: tuple[int, ...] = (50, 90, 99)) -> dict[int, float]:
        values = [v for r in self.records.values() if (v := getattr(r, name)) is not None]
        if not values:
            return {q: float("nan") for q in qs}
        return {q: float(np.percentile(values, q)) for q in qs}

    def summary(self, max_seqs: int, max_batched_tokens: int) -> dict[str, float]:
        finished = [r for r in self.records.values() if r.finish_reason not in ("", "rejected")]
        num_out = sum(len(r.output) for r in finished)
        seqs = np.asarray(self.step_seqs or [0], dtype=np.float64)
        tokens = np.asarray(self.step_tokens or [0], dtype=np.float64)
        return {
            "requests": len(self.records), "finished": len(finished),
            "rejected": sum(r.finish_reason == "rejected" for r in self.records.values()),
            "steps": self.num_steps, "duration_s": self.duration_s,
            "output_tokens": num_out,
            "output_tokens_per_s": num_out / self.duration_s if self.duration_s else 0.0,
            "mean_seqs_per_step": float(seqs.mean()),
            "seq_occupancy": float(seqs.mean()) / max_seqs,
            "token_occupancy": float(tokens.mean()) / max_batched_tokens,
            "prefix_cache_hit_ratio": self.stats.get("prefix_cache_hit_ratio", 0.0),
            "preemptions": self.stats.get("num_preemptions", 0.0),
        }
