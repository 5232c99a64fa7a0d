"""The frontend's link to the scheduler: submit/abort over ZMQ, per-request delta streams.

One background task reads the scheduler's coalesced `TokenDeltas` (one message per step)
and fans them out to per-request asyncio queues; `SchedulerStats` snapshots are kept for
/metrics and /health. Each open stream keeps its SubmitRequest and the tokens delivered to
it, so that when the scheduler dies (`detach`: new and open requests are held) a restarted
one (its `SchedulerStarted`) gets every open request back as prompt + delivered tokens
(`_reattach`), and greedy and seeded requests continue as if nothing happened.
Owns: in-flight request streams of this frontend. Does not own: tokenization or text (the
API layers above), nor any scheduling state, nor watching the scheduler (lifecycle.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
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
    FINISH_ABORT,
    FINISH_ERROR,
    AbortRequest,
    SchedulerStarted,
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

    def __init__(self, request: SubmitRequest) -> None:
        self.request = request
        self.request_id = request.request_id
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.finished = False
        self.submitted_s = time.monotonic()
        self.delivered: list[int] = []  # every token put on the queue (a resubmission's output)
        self.is_aborted = False  # an abort was sent; its final delta has not come back

    def resubmission(self) -> SubmitRequest:
        """The request for a restarted scheduler: its prompt, and what it delivered as output."""
        return dataclasses.replace(self.request, output_token_ids=as_int32(self.delivered))

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

    def __init__(self, scheduler_endpoint: str, frontend_endpoint: str,
                 scheduler_pid: int = 0) -> None:
        """scheduler_pid: the first scheduler's process (0: taken from its SchedulerStarted)."""
        self._context = zmq.asyncio.Context.instance()
        self._scheduler_endpoint = scheduler_endpoint
        self._to_scheduler: zmq.Socket | None = self._connect()
        self._from_scheduler = cast(zmq.asyncio.Socket, transport.make_socket(
            self._context, zmq.PULL, frontend_endpoint, bind=True))
        self._streams: dict[str, RequestStream] = {}
        self._reader: asyncio.Task | None = None
        self.stats: SchedulerStats | None = None
        self.stats_received_s = 0.0
        self.scheduler_lost = False
        self.scheduler_pid = scheduler_pid
        self.num_restarts = 0  # schedulers that took the open requests over
        self.attached = asyncio.Event()  # cleared while the scheduler is down (detach)
        self.attached.set()
        self.timeline = Timeline.from_env("frontend")

    def _connect(self) -> zmq.Socket:
        return transport.make_socket(self._context, zmq.PUSH, self._scheduler_endpoint,
                                     bind=False)

    async def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        self.timeline.dump()
        if self._reader is not None:
            self._reader.cancel()
        if self._to_scheduler is not None:
            self._to_scheduler.close(0)
        self._from_scheduler.close(0)

    @property
    def is_restarting(self) -> bool:
        """The scheduler died and its successor has not taken the open requests over yet."""
        return not self.attached.is_set() and not self.scheduler_lost

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def submit(self, request: SubmitRequest) -> RequestStream:
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        stream = RequestStream(request)
        self._streams[request.request_id] = stream
        if self._to_scheduler is not None:  # else held for the restarted scheduler
            transport.send(self._to_scheduler, request)
        self.timeline.mark("submit")
        return stream

    def abort(self, request_id: str) -> None:
        """Abort if still running (idempotent); the stream gets a final 'abort' delta."""
        self._abort([request_id] if request_id in self._streams else [])

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown); each stream ends with 'abort'."""
        self._abort(list(self._streams))

    def _abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        if self._to_scheduler is None:  # no scheduler to tell: the streams end here
            for request_id in request_ids:
                self._end(request_id, RequestDelta([], FINISH_ABORT))
            return
        for request_id in request_ids:
            self._streams[request_id].is_aborted = True
        transport.send(self._to_scheduler, AbortRequest(request_ids=request_ids))

    def _end(self, request_id: str, delta: RequestDelta) -> None:
        self._streams.pop(request_id).queue.put_nowait(delta)

    # ---------------------------------------------------------------- scheduler restarts
    def detach(self) -> None:
        """The scheduler died and a new one is coming: stop sending to the endpoint (what
        the dead one never read is dropped, it is all resubmitted) and hold every open and
        new request for its successor (idempotent)."""
        if self._to_scheduler is not None:
            self._to_scheduler.close(0)
            self._to_scheduler = None
        self.attached.clear()

    def _on_scheduler_started(self, started: SchedulerStarted) -> None:
        if started.pid == self.scheduler_pid:
            return
        if not self.scheduler_pid:  # the first scheduler, whose pid was not known
            self.scheduler_pid = started.pid
            return
        logger.warning("a new scheduler (pid %d, restart %d) took over from pid %d: "
                       "resubmitting %d open request(s)", started.pid, started.num_restarts,
                       self.scheduler_pid, len(self._streams))
        self.detach()  # (its death may not have been noticed yet)
        self.scheduler_pid = started.pid
        self._reattach()

    def _reattach(self) -> None:
        """Resubmit every open request (aborted ones end here: nothing more is wanted)."""
        self._to_scheduler = self._connect()
        for stream in list(self._streams.values()):
            if stream.is_aborted:
                self._end(stream.request_id, RequestDelta([], FINISH_ABORT))
            else:
                transport.send(self._to_scheduler, stream.resubmission())
        self.num_restarts += 1
        self.attached.set()

    def is_healthy(self) -> bool:
        return not self.health_problems()

    def health_problems(self) -> list[str]:
        """Why the engine cannot serve now, one line each; [] when healthy."""
        if self.scheduler_lost:
            return ["the scheduler is gone"]
        if self.is_restarting:
            return [f"the scheduler is restarting ({len(self._streams)} request(s) held for it)"]
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
            elif isinstance(message, SchedulerStarted):
                self._on_scheduler_started(message)

    def fail_all(self, reason: str) -> None:
        """The scheduler is gone: end every open stream with an error."""
        self.scheduler_lost = True
        self.attached.set()  # nothing to wait for any more
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(RequestDelta([], FINISH_ERROR, error=reason))
        self._streams.clear()

    def _dispatch(self, deltas: TokenDeltas) -> None:
        if self.scheduler_pid and deltas.scheduler_pid not in (0, self.scheduler_pid):
            return  # the dead scheduler's, read after its successor took over: recomputed
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
            stream.delivered.extend(delta.token_ids)
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
