"""What the scheduler tracks per worker: its running requests, its step in flight, health.

Owns: per-worker bookkeeping (which requests the worker holds state for, ids it must be
told to drop). Does not own: the requests themselves (SchedulerState) or heartbeats (the
process shell's HealthMonitor).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from justapi.scheduler.request import Request
from justapi.scheduler.topology import ROLE_MIXED


@dataclass(eq=False)
class InFlightStep:
    """A plan sent to a worker whose StepResult has not come back (StepBatch's columns)."""

    step_id: int
    reqs: list[Request]
    num_drafts: list[int]
    is_sampled: list[bool]
    sampled_request_ids: list[str]
    ends: list[int] = field(default_factory=list)  # per chunk: KV is written below this position
    deferred_blocks: list[tuple[int, str]] = field(default_factory=list)
    """(block id, holder) released when this step lands: a cached duplicate the request gave
    up while this step may still read it (overlap.py)."""
    num_steps: int = 1  # multi-step decoding: steps the plan runs, a token each per request


@dataclass(eq=False)
class WorkerState:
    worker_id: int
    pool_id: int
    role: str = ROLE_MIXED  # mixed | prefill | decode (topology.py)
    running: dict[str, Request] = field(default_factory=dict)  # admission order
    in_flight: list[InFlightStep] = field(default_factory=list)  # oldest first (overlap: 2)
    known: set[str] = field(default_factory=set)  # requests the worker holds state for
    pending_drops: dict[str, None] = field(default_factory=dict)  # for finished_request_ids
    discarded_step_ids: set[int] = field(default_factory=set)  # steps lost to ill health
    is_healthy: bool = True
    is_draining: bool = False  # admin drain: finishes what it runs, admits nothing new
    num_steps: int = 0  # counters, exported per worker on /metrics
    num_scheduled_tokens: int = 0

    @property
    def is_idle(self) -> bool:
        return self.is_healthy and not self.in_flight

    @property
    def is_accepting(self) -> bool:
        """Healthy and not draining: may admit new requests."""
        return self.is_healthy and not self.is_draining

    def forget(self, request_id: str) -> None:
        """The request left this worker: tell the worker to drop its state with the next plan."""
        if request_id in self.known:
            self.known.discard(request_id)
            self.pending_drops[request_id] = None

    def learn(self, request_id: str) -> None:
        """The next plan carries a NewRequest for it (which replaces any stale state)."""
        self.known.add(request_id)
        self.pending_drops.pop(request_id, None)
