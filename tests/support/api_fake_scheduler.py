"""A small fake scheduler for the frontend's tests: real ZMQ sockets, scripted tokens.

It binds the scheduler's PULL endpoint and pushes to the frontend's, like the real scheduler
process: each SubmitRequest gets its scripted tokens (a few per step, coalesced into one
TokenDeltas per step), stop token ids / EOS / max_tokens finish it, AbortRequest finishes it
with "abort", and a SchedulerStats snapshot goes out periodically. It records everything it
received so tests can assert what the frontend sent.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq

from justapi.wire import transport
from justapi.wire.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    AbortRequest,
    SchedulerStats,
    SubmitRequest,
    TokenDeltas,
)

Script = Callable[[SubmitRequest], list[int]]
BLOCK_SIZE = 16


@dataclass
class _Running:
    request: SubmitRequest
    script: list[int]
    num_emitted: int = 0
    num_cached_tokens: int = 0
    first: bool = True


@dataclass
class _StepOutput:
    request_ids: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_lps: list[list[float]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    embedding_ids: list[str] = field(default_factory=list)
    embeddings: list[np.ndarray] = field(default_factory=list)


FAKE_HIDDEN = 8


def fake_embedding(prompt: np.ndarray) -> np.ndarray:
    """The fake's pooled state of a prompt (unnormalized): float32 [FAKE_HIDDEN]."""
    ids = prompt.astype(np.float64)
    return np.asarray([len(ids), ids.sum(), ids[0], ids[-1], *(ids[:4] % 7).tolist(),
                       0, 0, 0, 0][:FAKE_HIDDEN], dtype=np.float32) + 1


class FakeScheduler:
    """Thread with its own zmq context; start() then point an EngineClient at `endpoints`."""

    def __init__(self, runtime_dir: str, script: Script, *, eos_token_ids: tuple[int, ...] = (),
                 tokens_per_step: int = 1, step_s: float = 0.001) -> None:
        self.scheduler_endpoint = transport.ipc_endpoint(runtime_dir, "fake-scheduler")
        self.frontend_endpoint = transport.ipc_endpoint(runtime_dir, "fake-frontend")
        self.script = script
        self.eos_token_ids = set(eos_token_ids)
        self.tokens_per_step = tokens_per_step
        self.step_s = step_s
        self.submitted: list[SubmitRequest] = []
        self.aborted: list[str] = []
        self.paused = threading.Event()  # while set, no tokens are produced
        self.healthy = True
        self.stats_interval_s = 0.02
        self.extra_stats: dict = {}
        self.fail_message: str | None = None  # set: requests fail after `fail_after` tokens
        self.fail_after = 2
        self._running: dict[str, _Running] = {}
        self._seen_prompts: set[bytes] = set()
        self._counters = {"prefix_cache_hits": 0, "prefix_cache_misses": 0,
                          "prefix_cache_hit_tokens": 0, "prefix_cache_query_tokens": 0,
                          "num_preemptions": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-scheduler", daemon=True)
        self._context = zmq.Context()
        self._inbox = transport.make_socket(self._context, zmq.PULL, self.scheduler_endpoint,
                                            bind=True)
        self._outbox: zmq.Socket | None = None

    def start(self) -> FakeScheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.002)
        return condition()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        self._outbox = transport.make_socket(self._context, zmq.PUSH, self.frontend_endpoint,
                                             bind=False)
        last_step = last_stats = 0.0
        while not self._stop.is_set():
            busy = bool(self._running) and not self.paused.is_set()
            if self._inbox.poll(int(self.step_s * 1000) if busy else 10):
                for _, message in transport.drain(self._inbox):
                    self._handle(message)
            now = time.monotonic()
            if self._running and now - last_step >= self.step_s:
                last_step = now
                self._step()
            if now - last_stats >= self.stats_interval_s:
                last_stats = now
                self._push_stats()
        self._outbox.close(0)

    def _handle(self, message: object) -> None:
        if isinstance(message, SubmitRequest):
            self.submitted.append(message)
            key = message.cache_salt.encode() + message.prompt_token_ids.tobytes()
            num_prompt = len(message.prompt_token_ids)
            is_hit = key in self._seen_prompts
            cached = ((num_prompt - 1) // BLOCK_SIZE) * BLOCK_SIZE if is_hit else 0
            self._seen_prompts.add(key)
            self._counters["prefix_cache_hits"] += cached // BLOCK_SIZE
            self._counters["prefix_cache_misses"] += num_prompt // BLOCK_SIZE - cached // BLOCK_SIZE
            self._counters["prefix_cache_hit_tokens"] += cached
            self._counters["prefix_cache_query_tokens"] += num_prompt
            self._running[message.request_id] = _Running(message, list(self.script(message)),
                                                         num_cached_tokens=cached)
        elif isinstance(message, AbortRequest):
            finished = []
            for request_id in message.request_ids:
                self.aborted.append(request_id)
                if self._running.pop(request_id, None) is not None:
                    finished.append(request_id)
            if finished:
                self._send(_StepOutput(request_ids=finished, counts=[0] * len(finished),
                                       reasons=[FINISH_ABORT] * len(finished),
                                       cached=[0] * len(finished)), has_logprobs=False)

    def _step(self) -> None:
        if self.paused.is_set():
            return
        out = _StepOutput()
        has_logprobs = False
        for request_id, state in list(self._running.items()):
            if state.request.pooling:  # an embedding: one step, its pooled state
                out.request_ids.append(request_id)
                out.counts.append(0)
                out.reasons.append(FINISH_STOP)
                out.cached.append(0)
                out.embedding_ids.append(request_id)
                out.embeddings.append(fake_embedding(state.request.prompt_token_ids))
                del self._running[request_id]
                continue
            tokens, reason = self._advance(state)
            sampling = state.request.sampling
            out.request_ids.append(request_id)
            out.counts.append(len(tokens))
            out.token_ids.extend(tokens)
            out.reasons.append(reason)
            out.cached.append(state.num_cached_tokens if state.first else 0)
            state.first = False
            if sampling.logprobs is not None:
                has_logprobs = True
            _add_logprobs(out, tokens, state.num_emitted - len(tokens), sampling.logprobs or 0)
            if reason == FINISH_ERROR:
                out.errors[request_id] = str(self.fail_message)
            if reason:
                del self._running[request_id]
        self._send(out, has_logprobs)

    def _advance(self, state: _Running) -> tuple[list[int], str]:
        sampling = state.request.sampling
        tokens: list[int] = []
        for _ in range(self.tokens_per_step):
            if self.fail_message is not None and state.num_emitted >= self.fail_after:
                return tokens, FINISH_ERROR
            if state.num_emitted >= len(state.script):
                return tokens, FINISH_STOP
            token = state.script[state.num_emitted]
            state.num_emitted += 1
            tokens.append(token)
            if token in sampling.stop_token_ids or (
                    token in self.eos_token_ids and not sampling.ignore_eos):
                return tokens, FINISH_STOP
            if state.num_emitted >= sampling.max_tokens:
                return tokens, FINISH_LENGTH
        return tokens, ""

    def _send(self, out: _StepOutput, has_logprobs: bool) -> None:
        width = max((len(row) for row in out.top_ids), default=0)
        extra = {}
        if has_logprobs:
            top_ids = np.full((len(out.token_ids), width), -1, dtype=np.int32)
            top_lps = np.full((len(out.token_ids), width), -np.inf, dtype=np.float32)
            for i, (ids, lps) in enumerate(zip(out.top_ids, out.top_lps)):
                top_ids[i, :len(ids)] = ids
                top_lps[i, :len(lps)] = lps
            extra = {"logprobs": np.asarray(out.logprobs, dtype=np.float32),
                     "top_logprob_ids": top_ids, "top_logprobs": top_lps}
        if out.embedding_ids:
            extra["embedding_request_ids"] = out.embedding_ids
            extra["embeddings"] = np.stack(out.embeddings)
        transport.send(self._outbox, TokenDeltas(
            step_id=0, request_ids=out.request_ids,
            num_new_tokens=np.asarray(out.counts, dtype=np.int32),
            token_ids=np.asarray(out.token_ids, dtype=np.int32), finish_reasons=out.reasons,
            num_cached_tokens=np.asarray(out.cached, dtype=np.int32), errors=out.errors,
            **extra))

    def _push_stats(self) -> None:
        """Stats named as justapi/scheduler/stats.py names them; the health table as
        justapi/health/table.py builds it."""
        running = len(self._running)
        stats = {"num_requests_running": running, "num_requests_waiting": 0,
                 "kv_usage": min(1.0, running / 64), "pool_0_kv_usage": min(1.0, running / 64),
                 "worker_0_num_requests_running": running, "worker_0_is_healthy": 1.0,
                 "prefix_cache_blocks": len(self._seen_prompts),
                 "prefix_cache_hit_ratio": _ratio(self._counters), **self._counters,
                 **self.extra_stats}
        workers = [{"worker_id": 0, "pool_id": 0, "healthy": self.healthy, "reason": "",
                    "rss_bytes": 0, "cpu_time_s": 0.0, "gpu": {}}]
        problems = [] if self.healthy else ["worker 0: no heartbeat for 2.0s"]
        transport.send(self._outbox, SchedulerStats(time_s=time.time(), healthy=self.healthy,
                                                    stats=stats, workers=workers,
                                                    problems=problems))


def _ratio(counters: dict) -> float:
    total = counters["prefix_cache_hits"] + counters["prefix_cache_misses"]
    return counters["prefix_cache_hits"] / total if total else 0.0


def fake_logprob(position: int) -> float:
    """The logprob the fake reports for the output token at `position` (0-based)."""
    return -0.125 * (position + 1)


def _add_logprobs(out: _StepOutput, tokens: list[int], first_position: int, top_n: int) -> None:
    for offset, token in enumerate(tokens):
        logprob = fake_logprob(first_position + offset)
        out.logprobs.append(logprob)
        out.top_ids.append([token + k for k in range(top_n)])
        out.top_lps.append([logprob - k for k in range(top_n)])
