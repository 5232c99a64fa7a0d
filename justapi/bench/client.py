"""The HTTP side of `justapi bench serve`: streams requests to an OpenAI-compatible server
(/v1/completions or /v1/chat/completions, SSE) and times each one.

Owns: request bodies, SSE parsing, per-request timing and token counting, launch pacing
(concurrency cap, arrival offsets), Ctrl-C during a run, the reachability check.
Does not own: workloads (workloads.py), statistics and reports (report.py).
"""
from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx
from tqdm import tqdm

from justapi.bench.workloads import BenchRequest, TokenizerSizer

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchError(Exception):
    """A run that cannot start (bad flags, unreachable server); printed as one line."""


@dataclass(frozen=True)
class ClientConfig:
    """How each request is sent and counted."""

    base_url: str = DEFAULT_BASE_URL
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    counter: TokenizerSizer | None = None
    """Counts output tokens from the text when the server sends no usage."""

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose one of "
                             f"{tuple(ENDPOINT_PATHS)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class RequestRecord:
    """What one request measured; times are seconds, `start_s` is relative to the run."""

    index: int
    group: str
    start_s: float
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    """Gaps between consecutive SSE chunks that carried text (a chunk may hold >1 token)."""
    num_chunks: int = 0
    output_tokens: int = 0
    output_tokens_source: str = "chunks"
    """'usage' (the server's final usage chunk), 'tokenizer' (our count of the text) or
    'chunks' (one token per text chunk: exact only for servers that stream per token)."""
    prompt_tokens: int = 0
    prompt_tokens_source: str = "target"
    output_text: str = ""
    """The streamed text, when the caller asked to keep it (multi-turn: the next turn's
    history)."""


@dataclass
class StreamState:
    """Raw observations of one SSE stream, turned into a RequestRecord at the end."""

    chunk_times_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None


# ---------------------------------------------------------------- one request
def request_body(config: ClientConfig, request: BenchRequest) -> dict[str, Any]:
    """The JSON body of a streaming request with a final usage chunk."""
    body: dict[str, Any] = {"max_tokens": request.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": config.temperature}
    if config.model:
        body["model"] = config.model
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_request(client: httpx.AsyncClient, config: ClientConfig,
                       request: BenchRequest, run_start: float,
                       keep_text: bool = False) -> RequestRecord:
    """Stream one request; failures are recorded, never raised (cancellation excepted)."""
    start = time.perf_counter()
    record = RequestRecord(request.index, request.group, start_s=start - run_start,
                           prompt_tokens=request.prompt_tokens)
    state = StreamState()
    url = config.base_url.rstrip("/") + ENDPOINT_PATHS[config.endpoint]
    try:
        async with client.stream("POST", url, json=request_body(config, request),
                                 headers=auth_headers(config.api_key)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {error_message(text)}"
                return record
            await read_stream(response, state, start, config.endpoint)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}".strip()
        return record
    except ValueError as exc:  # bad JSON or an error event inside the stream
        record.error = str(exc)
        return record
    finish_record(record, state, time.perf_counter() - start, config.counter)
    if keep_text:
        record.output_text = "".join(state.texts)
    return record


async def read_stream(response: httpx.Response, state: StreamState, start: float,
                      endpoint: str) -> None:
    """Collect text-chunk arrival times, texts and the last usage until [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, 'event:' lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        now = time.perf_counter()
        text, usage = parse_chunk(data, endpoint)
        if usage:
            state.usage = usage
        if text:
            state.chunk_times_s.append(now - start)
            state.texts.append(text)


def parse_chunk(data: str, endpoint: str) -> tuple[str, dict[str, Any] | None]:
    """(text, usage) of one SSE data payload; ValueError for a malformed chunk or an
    error event. Text is choices[0].text (completions) or choices[0].delta.content (chat)."""
    try:
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error event in stream: {error_message(data)}")
        choices = chunk.get("choices") or [{}]  # [] in the usage-only final chunk
        if endpoint == "chat":
            text = (choices[0].get("delta") or {}).get("content") or ""
        else:
            text = choices[0].get("text") or ""
        usage = chunk.get("usage")
    except (json.JSONDecodeError, AttributeError, TypeError, IndexError, KeyError):
        raise ValueError(f"malformed SSE chunk: {data[:120]!r}") from None
    if not isinstance(text, str) or not isinstance(usage, (dict, type(None))):
        raise ValueError(f"malformed SSE chunk: {data[:120]!r}")
    return text, usage


def error_message(body: str) -> str:
    """The 'message' of an OpenAI-style error body, else the body's start."""
    try:
        parsed = json.loads(body)
        error = parsed.get("error", parsed)
        message = error.get("message") if isinstance(error, dict) else error
        return str(message or parsed)[:300]
    except (json.JSONDecodeError, AttributeError):
        return body.strip()[:300]


def finish_record(record: RequestRecord, state: StreamState, e2e_s: float,
                  counter: TokenizerSizer | None) -> None:
    """Derive TTFT, ITLs, token counts and TPOT from the stream's observations."""
    times = state.chunk_times_s
    record.ok, record.e2e_s, record.num_chunks = True, e2e_s, len(times)
    record.ttft_s = times[0] if times else None
    record.itl_s = [later - earlier for earlier, later in zip(times, times[1:])]
    usage = state.usage or {}
    if isinstance(usage.get("completion_tokens"), int):
        record.output_tokens, record.output_tokens_source = usage["completion_tokens"], "usage"
    elif counter is not None:
        record.output_tokens = counter.count("".join(state.texts))
        record.output_tokens_source = "tokenizer"
    else:
        record.output_tokens, record.output_tokens_source = len(times), "chunks"
    if isinstance(usage.get("prompt_tokens"), int):
        record.prompt_tokens, record.prompt_tokens_source = usage["prompt_tokens"], "usage"
    if record.ttft_s is not None and record.output_tokens > 1:
        record.tpot_s = (e2e_s - record.ttft_s) / (record.output_tokens - 1)


# ---------------------------------------------------------------- the run
@dataclass
class RunResult:
    """Records of the requests that finished, the run's wall time, and whether Ctrl-C
    cut it short (then unfinished requests have no record)."""

    records: list[RequestRecord]
    duration_s: float
    interrupted: bool = False


@dataclass(frozen=True)
class Pacing:
    """When requests launch: `offsets_s[i]` after the start (None: at once), at most
    `concurrency` in flight (None: no cap)."""

    offsets_s: Sequence[float | None]
    concurrency: int | None = None


async def run_requests(config: ClientConfig, requests: Sequence[BenchRequest],
                       pacing: Pacing, show_progress: bool = False) -> RunResult:
    """Send every request under `pacing`; SIGINT (main thread only) stops the run early."""
    assert len(pacing.offsets_s) == len(requests)
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(pacing.concurrency) if pacing.concurrency else None
    limits = httpx.Limits(max_connections=pacing.concurrency or len(requests),
                          max_keepalive_connections=pacing.concurrency or len(requests))
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    with tqdm(total=len(requests), unit="req", disable=not show_progress,
              file=sys.stderr) as progress:
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            run_start = time.perf_counter()

            async def launch(request: BenchRequest, offset_s: float | None) -> None:
                if offset_s:
                    await asyncio.sleep(max(0.0, run_start + offset_s - time.perf_counter()))
                if gate is None:
                    records.append(await send_request(client, config, request, run_start))
                else:
                    async with gate:
                        records.append(await send_request(client, config, request, run_start))
                progress.update(1)

            tasks = [asyncio.create_task(launch(r, o)) for r, o in zip(requests, pacing.offsets_s)]
            interrupted = await gather_until_sigint(tasks)
            duration_s = time.perf_counter() - run_start
    records.sort(key=lambda record: record.index)
    return RunResult(records, duration_s, interrupted)


async def gather_until_sigint(tasks: list[asyncio.Task[None]]) -> bool:
    """Wait for all tasks; the first SIGINT cancels them (a second one kills the process)."""
    loop = asyncio.get_running_loop()
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        loop.remove_signal_handler(signal.SIGINT)
        for task in tasks:
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        has_handler = True
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
        has_handler = False
    try:
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if has_handler and not interrupted:
            loop.remove_signal_handler(signal.SIGINT)
    for outcome in outcomes:  # send_request records failures: anything else is a bug
        if isinstance(outcome, Exception):  # (CancelledError is no Exception)
            raise outcome
    return interrupted


async def resolve_model(config: ClientConfig) -> str | None:
    """Check the server answers (BenchError if not) and return the model to ask for:
    --model, else the first id of /v1/models, else None (the body then names none)."""
    url = config.base_url.rstrip("/") + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as client:
            response = await client.get(url, headers=auth_headers(config.api_key))
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise BenchError(f"cannot reach server at {config.base_url}: {reason}") from None
    if config.model:
        return config.model
    try:
        return str(response.json()["data"][0]["id"]) if response.status_code == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None
