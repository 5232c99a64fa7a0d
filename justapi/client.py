"""Programmatic client of a running `justapi serve` over ZeroMQ: generate (streaming), abort, stats.

Speaks the codec's frames (orjson header + numpy frames, never pickle) to the frontend's
ROUTER through one DEALER socket. `Client` blocks (one thread per client); `AsyncClient`
runs on asyncio and multiplexes many concurrent generations over one socket. See docs/api.md.
Owns: this process's connection and its pending generations. Does not own: tokenization,
detokenization or stop strings (the frontend does them).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import zmq
import zmq.asyncio

from justapi.sampling import BUILTIN_SAMPLING_DEFAULTS, SamplingParams
from justapi.wire import transport
from justapi.wire.codec import ProtocolError, decode, encode
from justapi.wire.protocol import (
    FINISH_ERROR,
    AbortGeneration,
    GenerationChunk,
    QueryStats,
    StatsReport,
    SubmitGeneration,
)

DEFAULT_STATS_TIMEOUT_S = 10.0
TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")
"""Keyword options of a chat generation that go to the frontend as OpenAI's tool fields."""
READER_YIELD_EVERY = 64


@dataclass
class Completion:
    """A whole generation, gathered from its chunks."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    """With tools: the calls, as OpenAI's message.tool_calls ({id, type, function: {name,
    arguments}}); finish_reason is then "tool_calls"."""


class GenerationError(RuntimeError):
    """The server refused or failed a generation; the message is the server's."""


def make_submit(prompt: str | Sequence[int] | None, messages: list[dict] | None,
                sampling: SamplingParams | None, options: dict[str, Any]) -> SubmitGeneration:
    """Build the wire request; sampling keyword arguments are validated here, at the edge.
    Sampling fields the keywords leave out take the server's defaults (as over HTTP); a
    `sampling` object is sent as it is."""
    request_id = options.pop("request_id", None) or uuid.uuid4().hex
    stop = options.pop("stop", None) or []
    add_special_tokens = options.pop("add_special_tokens", True)
    priority = int(options.pop("priority", 0))
    tools = {name: options.pop(name) for name in TOOL_OPTIONS if name in options}
    unset: list[str] = []
    if sampling is None:
        sampling = SamplingParams(**options)
        unset = [name for name in BUILTIN_SAMPLING_DEFAULTS if name not in options]
    elif options:
        raise ValueError(f"pass sampling parameters either as `sampling` or as keywords, "
                         f"not both (got {sorted(options)})")
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) and messages")
    text, token_ids = "", np.zeros(0, dtype=np.int32)
    if isinstance(prompt, str):
        text = prompt
    elif prompt is not None:
        token_ids = np.asarray(list(prompt), dtype=np.int32)
    return SubmitGeneration(client_request_id=request_id, sampling=sampling, prompt=text,
                            prompt_token_ids=token_ids, messages=list(messages or []),
                            stop=[stop] if isinstance(stop, str) else list(stop),
                            add_special_tokens=add_special_tokens, unset_sampling=unset,
                            tool_options=json.dumps(tools) if tools else "",
                            priority=priority)


def gather(request_id: str, chunks: Sequence[GenerationChunk]) -> Completion:
    token_ids: list[int] = []
    logprobs: list[float] = []
    for chunk in chunks:
        token_ids.extend(chunk.token_ids.tolist())
        if chunk.logprobs is not None:
            logprobs.extend(chunk.logprobs.tolist())
    last = chunks[-1]
    return Completion(request_id=request_id, text="".join(c.text for c in chunks),
                      token_ids=token_ids, finish_reason=last.finish_reason,
                      num_prompt_tokens=max(c.num_prompt_tokens for c in chunks),
                      num_cached_tokens=max(c.num_cached_tokens for c in chunks),
                      logprobs=logprobs, error=last.error,
                      tool_calls=assemble_tool_calls(d for c in chunks for d in c.tool_calls))


def assemble_tool_calls(deltas: Iterable[dict]) -> list[dict]:
    """OpenAI's streamed tool call deltas -> whole calls ({id, type, function: {name,
    arguments}}), in index order."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        function = delta.get("function", {})
        call = calls.setdefault(delta["index"], {"id": "", "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
        call["id"] = delta.get("id") or call["id"]
        call["function"]["name"] = function.get("name") or call["function"]["name"]
        call["function"]["arguments"] += function.get("arguments", "")
    return [calls[index] for index in sorted(calls)]


def _dealer(context: zmq.Context, endpoint: str, server_public_key: bytes | None) -> zmq.Socket:
    return transport.make_socket(context, zmq.DEALER, endpoint, bind=False,
                                 identity=f"client-{uuid.uuid4().hex}".encode(),
                                 curve_server_key=server_public_key)


class Stream:
    """Iterator over one generation's chunks; closing it early aborts the generation."""

    def __init__(self, request_id: str, chunks: Iterator[GenerationChunk]) -> None:
        self.request_id = request_id
        self._chunks = chunks

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> GenerationChunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Client:
    """Blocking client. Not thread-safe: one Client per thread (they can share a server).

        with Client("ipc:///run/justapi/client.sock") as client:
            for chunk in client.generate("The capital of France is", max_tokens=16):
                print(chunk.text, end="", flush=True)
    """

    def __init__(self, endpoint: str, *, timeout_s: float | None = None,
                 server_public_key: bytes | None = None) -> None:
        """timeout_s: longest wait for any answer (None: forever); server_public_key (z85):
        talk CURVE to a server started with the matching secret key."""
        self._context = zmq.Context()
        self._socket = _dealer(self._context, endpoint, server_public_key)
        self._timeout_s = timeout_s
        self._pending: dict[str, deque[GenerationChunk]] = {}
        self._reports: dict[str, StatsReport] = {}

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: list[dict] | None = None, sampling: SamplingParams | None = None,
                 **options: Any) -> Stream:
        """Start a generation; iterate the result for chunks (the last has finish_reason).
        Options: stop, add_special_tokens, request_id, SamplingParams fields (those left
        out take the server's defaults; `structured` constrains the output), and with
        messages OpenAI's tools, tool_choice and parallel_tool_calls."""
        submit = make_submit(prompt, messages, sampling, options)
        request_id = submit.client_request_id
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self._pending[request_id] = deque()
        self._send(submit)
        return Stream(request_id, self._chunks(request_id))

    def complete(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """Generate to the end; raises GenerationError when the server refused or failed."""
        stream = self.generate(prompt, **kwargs)
        completion = gather(stream.request_id, list(stream))
        if completion.finish_reason == FINISH_ERROR:
            raise GenerationError(completion.error or "generation failed")
        return completion

    def abort(self, request_id: str) -> None:
        """Abort a running generation; its stream ends with finish_reason 'abort'."""
        self._send(AbortGeneration(client_request_ids=[request_id]))

    def stats(self, timeout_s: float = DEFAULT_STATS_TIMEOUT_S) -> StatsReport:
        query_id = uuid.uuid4().hex
        self._send(QueryStats(query_id=query_id))
        while query_id not in self._reports:
            self._receive(timeout_s)
        return self._reports.pop(query_id)

    def close(self) -> None:
        for request_id in list(self._pending):
            self.abort(request_id)
        self._pending.clear()
        self._socket.close(0)
        self._context.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _chunks(self, request_id: str) -> Iterator[GenerationChunk]:
        finished = False
        try:
            while not finished:
                queue = self._pending[request_id]
                while not queue:
                    self._receive(self._timeout_s)
                chunk = queue.popleft()
                finished = bool(chunk.finish_reason)
                yield chunk
        finally:
            self._pending.pop(request_id, None)
            if not finished and not self._socket.closed:
                self.abort(request_id)

    def _send(self, message: Any) -> None:
        self._socket.send_multipart(encode(message), copy=False)

    def _receive(self, timeout_s: float | None) -> None:
        """Wait for one message and file it under its request or query."""
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if not self._socket.poll(timeout_ms):
            raise TimeoutError(f"no answer from the server in {timeout_s} s")
        try:
            message = decode(self._socket.recv_multipart(copy=False))
        except ProtocolError:
            return
        if isinstance(message, GenerationChunk):
            queue = self._pending.get(message.client_request_id)
            if queue is not None:
                queue.append(message)
        elif isinstance(message, StatsReport):
            self._reports[message.query_id] = message


class AsyncClient:
    """asyncio client: many concurrent generations over one socket.

        async with AsyncClient(endpoint) as client:
            async for chunk in client.generate([1, 2, 3], max_tokens=8, temperature=0):
                ...
    """

    def __init__(self, endpoint: str, *, server_public_key: bytes | None = None) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = cast(zmq.asyncio.Socket,
                            _dealer(self._context, endpoint, server_public_key))
        self._pending: dict[str, asyncio.Queue[GenerationChunk]] = {}
        self._reports: dict[str, asyncio.Future[StatsReport]] = {}
        self._reader: asyncio.Task | None = None

    async def generate(self, prompt: str | Sequence[int] | None = None, *,
                       messages: list[dict] | None = None,
                       sampling: SamplingParams | None = None,
                       **options: Any) -> AsyncIterator[GenerationChunk]:
        """Async generator of chunks; leaving it early (break, cancel) aborts the generation."""
        submit = make_submit(prompt, messages, sampling, options)
        request_id = submit.client_request_id
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[GenerationChunk] = asyncio.Queue()
        self._pending[request_id] = queue
        finished = False
        try:
            await self._send(submit)
            while not finished:
                chunk = await queue.get()
                finished = bool(chunk.finish_reason)
                yield chunk
        finally:
            self._pending.pop(request_id, None)
            if not finished and not self._socket.closed:
                await self._send(AbortGeneration(client_request_ids=[request_id]))

    async def complete(self, prompt: str | Sequence[int] | None = None,
                       **kwargs: Any) -> Completion:
        request_id = kwargs.setdefault("request_id", uuid.uuid4().hex)
        chunks = [chunk async for chunk in self.generate(prompt, **kwargs)]
        completion = gather(request_id, chunks)
        if completion.finish_reason == FINISH_ERROR:
            raise GenerationError(completion.error or "generation failed")
        return completion

    async def abort(self, request_id: str) -> None:
        await self._send(AbortGeneration(client_request_ids=[request_id]))

    async def stats(self, timeout_s: float = DEFAULT_STATS_TIMEOUT_S) -> StatsReport:
        query_id = uuid.uuid4().hex
        future: asyncio.Future[StatsReport] = asyncio.get_running_loop().create_future()
        self._reports[query_id] = future
        try:
            await self._send(QueryStats(query_id=query_id))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._reports.pop(query_id, None)

    async def close(self) -> None:
        for request_id in list(self._pending):
            await self.abort(request_id)
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close(0)
        self._context.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _send(self, message: Any) -> None:
        if self._reader is None:  # started lazily: it needs the running loop
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        await self._socket.send_multipart(encode(message), copy=False)

    async def _read_loop(self) -> None:
        num_read = 0
        while True:
            num_read += 1
            if num_read % READER_YIELD_EVERY == 0:
                await asyncio.sleep(0)  # recv does not yield while messages wait: let readers run
            frames = await self._socket.recv_multipart(copy=False)
            try:
                message = decode(frames)
            except ProtocolError:
                continue
            if isinstance(message, GenerationChunk):
                queue = self._pending.get(message.client_request_id)
                if queue is not None:
                    queue.put_nowait(message)
            elif isinstance(message, StatsReport):
                future = self._reports.get(message.query_id)
                if future is not None and not future.done():
                    future.set_result(message)
