"""A worker's state of one request: its sampling parameters and every token it knows, by position.

Shared by the runner (workers/runner.py learns it from plans and drops it at finish) and the
speculative step (workers/spec/step.py rewrites the history after verification).
Owns: the fields. Does not own: when they change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from justapi.sampling import SamplingParams


@dataclass
class RequestState:
    params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)  # every token known, position-indexed
    num_known_tokens: int = 0
    """Tokens known when the request was announced (its prompt; after a preemption, the output
    too): the sequence length a LongRoPE model picks the table of that prefill by."""
    last_sampled: tuple[int, int] | None = None
    """(position, token) this worker sampled last: what a placeholder at that position in the
    next plan stands for (overlap: planned before the scheduler saw the token)."""
    pooling: str = ""
    """A pooling request's pooling (protocol.POOLINGS); "" for a generation."""
    pooled: Any = None
    """Its state between chunks (workers/pooling.py): mean: (sum [hidden], positions); cls:
    the first position's row."""
