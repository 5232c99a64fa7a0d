"""Request traces for simulation: JSON lines, and a seeded generator.

One line per request:
    {"arrival_s": 0.12, "prompt_len": 300, "output_len": 64, "prefix_id": 2, "prefix_len": 256,
     "priority": 0, "abort_after_s": null, "stop_on_eos": false}
or "prompt_token_ids": [...] instead of prompt_len. Requests with the same prefix_id share
their first prefix_len tokens (tokens drawn from a generator seeded by the prefix id), so a
trace is reproducible from its lines alone. output_len becomes max_tokens (with ignore_eos
unless stop_on_eos); abort_after_s, if set, aborts the request that long after arrival.
Owns: the trace format. Does not own: replay (simulation.py).
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

FIRST_TOKEN_ID = 2  # ids below are left to EOS-like tokens of the fake model


@dataclass
class TraceRequest:
    arrival_s: float
    output_len: int
    prompt_len: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    prefix_id: int | None = None
    prefix_len: int = 0
    priority: int = 0
    abort_after_s: float | None = None
    stop_on_eos: bool = False
    request_id: str = ""

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len!r}")
        if not self.prompt_token_ids and self.prompt_len < 1:
            raise ValueError("a trace request needs prompt_len >= 1 or prompt_token_ids")
        if self.prefix_id is not None and not 0 <= self.prefix_len <= max(self.prompt_len, 0):
            raise ValueError(f"prefix_len {self.prefix_len} must be in [0, prompt_len]")

    def tokens(self, index: int, vocab_size: int) -> list[int]:
        """The prompt: explicit ids, or shared prefix tokens then request-unique ones."""
        if self.prompt_token_ids:
            return list(self.prompt_token_ids)
        span = vocab_size - FIRST_TOKEN_ID
        prefix: list[int] = []
        if self.prefix_id is not None:
            rng = random.Random(f"prefix-{self.prefix_id}")
            prefix = [FIRST_TOKEN_ID + rng.randrange(span) for _ in range(self.prefix_len)]
        rng = random.Random(f"request-{index}")
        return prefix + [FIRST_TOKEN_ID + rng.randrange(span)
                         for _ in range(self.prompt_len - len(prefix))]


def load_trace(handle: TextIO) -> list[TraceRequest]:
    out = []
    for line_no, line in enumerate(handle, 1):
        if not line.strip():
            continue
        try:
            data: dict[str, Any] = json.loads(line)
            out.append(TraceRequest(**data))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trace line {line_no}: {exc}") from None
    return out


def dump_trace(trace: list[TraceRequest], handle: TextIO) -> None:
    for req in trace:
        data = {k: v for k, v in asdict(req).items()
                if not (v is None or v is False or v == [] or v == "")}
        handle.write(json.dumps(data) + "\n")


@dataclass(frozen=True)
class TraceSpec:
    """Knobs of the generator: Poisson arrivals, uniform lengths, shared-prefix groups."""

    num_requests: int = 200
    rate_per_s: float = 0.0  # 0: everything arrives at t=0
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)
    num_prefix_groups: int = 0
    prefix_len: int = 0
    prefix_fraction: float = 0.5  # share of requests that start with a group's prefix
    abort_fraction: float = 0.0
    seed: int = 0


def generate_trace(spec: TraceSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    now, out = 0.0, []
    for _ in range(spec.num_requests):
        if spec.rate_per_s > 0:
            now += rng.expovariate(spec.rate_per_s)
        prompt_len = rng.randint(*spec.prompt_len)
        prefix_id, prefix_len = None, 0
        if spec.num_prefix_groups and rng.random() < spec.prefix_fraction:
            prefix_id = rng.randrange(spec.num_prefix_groups)
            prefix_len = min(spec.prefix_len, prompt_len)
        abort = rng.uniform(0.0, 2.0) if rng.random() < spec.abort_fraction else None
        out.append(TraceRequest(arrival_s=round(now, 6), output_len=rng.randint(*spec.output_len),
                                prompt_len=prompt_len, prefix_id=prefix_id, prefix_len=prefix_len,
                                abort_after_s=abort))
    return out
