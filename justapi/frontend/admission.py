"""Whether a new request may start now: the bounded queue, the drain at shutdown, a lost scheduler.

Every generation request (HTTP or ZMQ) passes `Admission.check(num_requests)` once it is
validated and before anything is submitted. Past `max_in_flight` scheduler requests (the
workers' running capacity plus `--max-queue`) it is refused with 429 and `Retry-After`, so
an overload costs the client a retry instead of growing queues and latency without bound;
while the server drains at shutdown, or once the scheduler is gone, with 503. Each refusal
is counted in `justapi:requests_rejected_total{reason}`.
Owns: the admission rule, the draining flag and the rejection counter. Does not own: the
in-flight count (EngineClient) or the HTTP surface that turns refusals into responses.
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from justapi.frontend.engine_client import EngineClient
from justapi.frontend.errors import UNAVAILABLE, ApiError

logger = logging.getLogger(__name__)

RATE_LIMIT = "rate_limit_error"
QUEUE_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 5
REJECT_REASONS = ("queue_full", "draining", "scheduler_lost", "unauthorized", "too_large")


class RejectionCounter:
    """`justapi:requests_rejected_total{model_name, reason}`: requests refused before any work."""

    def __init__(self, registry: CollectorRegistry | None, model_name: str) -> None:
        self._counter = Counter("justapi:requests_rejected", "Requests refused before any "
                                "work (bounded queue, shutdown, lost scheduler, auth, size).",
                                ["model_name", "reason"], registry=registry)
        self._model_name = model_name
        for reason in REJECT_REASONS:  # every series exists from the start (alerts read 0)
            self._counter.labels(model_name, reason)

    def count(self, reason: str) -> None:
        self._counter.labels(self._model_name, reason).inc()


class Admission:
    """The admission rule of one frontend; `max_in_flight` 0 admits without a bound."""

    def __init__(self, engine: EngineClient, max_in_flight: int,
                 rejections: RejectionCounter) -> None:
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.rejections = rejections
        self.is_draining = False

    def start_draining(self) -> None:
        """From now on every new request is refused (503); running ones go on."""
        self.is_draining = True

    def check(self, num_requests: int = 1) -> None:
        """Raise ApiError (503 or 429, with Retry-After) unless `num_requests` scheduler
        requests may start now."""
        if self.engine.scheduler_lost:
            self.rejections.count("scheduler_lost")
            raise unavailable("the engine is not available (scheduler lost)")
        if self.is_draining:
            self.rejections.count("draining")
            raise unavailable("the server is shutting down; retry on another instance")
        in_flight = self.engine.num_in_flight
        if self.max_in_flight and in_flight + num_requests > self.max_in_flight:
            self.rejections.count("queue_full")
            raise ApiError(f"the server is at capacity ({in_flight} requests in flight, at most "
                           f"{self.max_in_flight}); retry after {QUEUE_RETRY_AFTER_S}s",
                           status=429, error_type=RATE_LIMIT, code="queue_full",
                           headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})


def unavailable(message: str) -> ApiError:
    return ApiError(message, status=503, error_type=UNAVAILABLE,
                    headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
