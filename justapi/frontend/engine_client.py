"""The frontend's link to the scheduler: submit/abort over ZMQ, per-request delta streams.

One background task reads the scheduler's coalesced `TokenDeltas` (one message per step)
and fans them out to per-request asyncio queues; `SchedulerStats` snapshots are kept for
/metrics and /health. Owns: in-flight request streams of this frontend. Does not own:
tokenization or text (the API layers above), nor any scheduling state.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import zmq
import zmq.asyncio

from justapi.ops.timeline import Timeline
from justapi.wire import transport
from justapi.wire.codec import ProtocolError, decode
from justapi.wire.protocol import (
    FINISH_ERROR,
    AbortRequest,
    SchedulerStats,
    SubmitRequest,
    TokenDeltas,
    offsets,
)

logger = logging.getLogger(__name__)

STATS_STALE_S = 5.0  # no snapshot for this long: the scheduler is not making progress


@dataclass
class RequestDelta:
    """New output of one request since the last delta."""

    token_ids: list[int]
    finish_reason: str = ""
    num_cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    error: str | None = None
    embedding: np.ndarray | None = None  # a pooling request's pooled state, float32 [hidden]


class RequestStream:
    """Async iterator over one request's deltas; ends after the delta with a finish_reason."""

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.finished = False
        self.submitted_s = time.monotonic()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        delta = await self.queue.get()
        merged = self._merge_ready(delta)
        if merged.finish_reason:
            self.finished = True
        return merged

    def _merge_ready(self, delta: RequestDelta) -> RequestDelta:
        """Coalesce deltas that queued up while the consumer was busy into one."""
        while not delta.finish_reason and not self.queue.empty():
            nxt = self.queue.get_nowait()
            delta = RequestDelta(
                token_ids=delta.token_ids + nxt.token_ids,
                finish_reason=nxt.finish_reason,
                num_cached_tokens=delta.num_cached_tokens + nxt.num_cached_tokens,
                logprobs=delta.logprobs + nxt.logprobs,
                top_logprobs=delta.top_logprobs + nxt.top_logprobs,
                error=nxt.error, embedding=nxt.embedding)
        return delta


class EngineClient:
    """Submit/abort requests to the scheduler and route its deltas back to their streams."""

    def __init__(self, scheduler_endpoint: str, frontend_endpoint: str) -> None:
        self._context = zmq.asyncio.Context.instance()
        self._to_scheduler = transport.make_socket(self._context, zmq.PUSH, scheduler_endpoint,
                                                   bind=False)
        self._from_scheduler = cast(zmq.asyncio.Socket, transport.make_socket(
            self._context, zmq.PULL, frontend_endpoint, bind=True))
        self._streams: dict[str, RequestStream] = {}
        self._reader: asyncio.Task | None = None
        self.stats: SchedulerStats | None = None
        self.stats_received_s = 0.0
        self.scheduler_lost = False
        self.timeline = Timeline.from_env("frontend")

    async def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        self.timeline.dump()
        if self._reader is not None:
            self._reader.cancel()
        self._to_scheduler.close(0)
        self._from_scheduler.close(0)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def submit(self, request: SubmitRequest) -> RequestStream:
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        stream = RequestStream(request.request_id, len(request.prompt_token_ids))
        self._streams[request.request_id] = stream
        transport.send(self._to_scheduler, request)
        self.timeline.mark("submit")
        return stream

    def abort(self, request_id: str) -> None:
        """Abort if still running (idempotent); the stream gets a final 'abort' delta."""
        if request_id in self._streams:
            transport.send(self._to_scheduler, AbortRequest(request_ids=[request_id]))

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown); each stream ends with 'abort'."""
        if self._streams:
            transport.send(self._to_scheduler, AbortRequest(request_ids=list(self._streams)))

    def is_healthy(self) -> bool:
        return not self.health_problems()

    def health_problems(self) -> list[str]:
        """Why the engine cannot serve now, one line each; [] when healthy."""
        if self.scheduler_lost:
            return ["the scheduler is gone"]
        if self.stats is None:
            return ["no status from the scheduler yet"]
        age_s = time.monotonic() - self.stats_received_s
        if age_s >= STATS_STALE_S:
            return [f"no status from the scheduler for {age_s:.1f}s"]
        if not self.stats.healthy:
            return [str(p) for p in self.stats.problems] or ["the scheduler reports unhealthy"]
        return []

    async def _read_loop(self) -> None:
        while True:
            frames = await self._from_scheduler.recv_multipart(copy=False)
            try:
                message = decode(frames)
            except ProtocolError as exc:
                logger.warning("dropped malformed message from scheduler: %s", exc)
                continue
            if isinstance(message, TokenDeltas):
                self.timeline.mark_cpu(message.step_id)
                self.timeline.mark("deltas_in", message.step_id, len(message.request_ids))
                self._dispatch(message)
            elif isinstance(message, SchedulerStats):
                self.stats = message
                self.stats_received_s = time.monotonic()

    def fail_all(self, reason: str) -> None:
        """The scheduler is gone: end every open stream with an error."""
        self.scheduler_lost = True
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(RequestDelta([], FINISH_ERROR, error=reason))
        self._streams.clear()

    def _dispatch(self, deltas: TokenDeltas) -> None:
        tok_off = offsets(deltas.num_new_tokens)
        has_logprobs = len(deltas.logprobs) > 0
        cached = deltas.num_cached_tokens
        embeddings = dict(zip(deltas.embedding_request_ids, deltas.embeddings)) \
            if deltas.embedding_request_ids else None
        for i, request_id in enumerate(deltas.request_ids):
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # e.g. an abort raced with the finish
            lo, hi = int(tok_off[i]), int(tok_off[i + 1])
            delta = RequestDelta(
                token_ids=deltas.token_ids[lo:hi].tolist(),
                finish_reason=deltas.finish_reasons[i],
                num_cached_tokens=int(cached[i]) if len(cached) else 0,
                error=deltas.errors.get(request_id))
            if embeddings is not None:
                delta.embedding = embeddings.get(request_id)
            if has_logprobs:
                delta.logprobs = deltas.logprobs[lo:hi].tolist()
                delta.top_logprobs = _top_pairs(deltas, lo, hi)
            stream.queue.put_nowait(delta)
            if delta.finish_reason:
                del self._streams[request_id]


def _top_pairs(deltas: TokenDeltas, lo: int, hi: int) -> list[list[tuple[int, float]]]:
    if deltas.top_logprob_ids.ndim != 2:
        return [[] for _ in range(hi - lo)]
    ids = deltas.top_logprob_ids[lo:hi]
    lps = deltas.top_logprobs[lo:hi]
    return [[(int(t), float(p)) for t, p in zip(row_ids, row_lps) if t >= 0]
            for row_ids, row_lps in zip(ids, lps)]


def as_int32(token_ids: list[int]) -> np.ndarray:
    return np.asarray(token_ids, dtype=np.int32)
