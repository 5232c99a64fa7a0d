"""The frontend's ZeroMQ endpoint for programmatic clients (justapi.client).

One ROUTER socket in the frontend's event loop; each client is a DEALER whose identity
namespaces its request ids, so clients can neither collide nor abort each other. Requests
go through the same Serving rules as HTTP (tokenizer, chat template, context limit, stop
strings, output constraints, tools); each running generation streams GenerationChunks back
(with tools: the content as text, the calls as OpenAI's deltas). A client that has gone
(the ROUTER cannot route to it any more) gets its generations aborted.
Owns: client sessions (identity, request id) -> generation. Does not own: request rules
(prompts.py, request_sampling.py), text state (generation.py), the client library.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import cast

import numpy as np
import orjson
import zmq
import zmq.asyncio
from pydantic import ValidationError

from justapi.frontend.choices import OutputRules
from justapi.frontend.constraints import Constraint, planned
from justapi.frontend.errors import ApiError, from_validation_errors
from justapi.frontend.generation import Generation, GenerationOutput
from justapi.frontend.openai_models import ChatCompletionRequest
from justapi.frontend.prompts import Prompt
from justapi.frontend.serving import Serving
from justapi.frontend.reply import ReplyRules
from justapi.frontend.serving_chat import chat_output_rules, chat_prompt
from justapi.frontend.tools.parser import ToolReply
from justapi.frontend.tools.request import ToolPlan, tool_plan
from justapi.sampling import SamplingParams, StructuredOutput
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

logger = logging.getLogger(__name__)

READER_YIELD_EVERY = 64
TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")
SessionKey = tuple[bytes, str]  # (client identity, client_request_id)


class ZmqServer:
    """Serve SubmitGeneration / AbortGeneration / QueryStats on `endpoint` until cancelled."""

    def __init__(self, serving: Serving, endpoint: str, *,
                 curve_secret_key: bytes | None = None) -> None:
        """curve_secret_key (z85): require CURVE-encrypted clients that know the matching
        public key (for tcp:// endpoints other hosts can reach)."""
        self._serving = serving
        self._context = zmq.asyncio.Context.instance()
        self._socket = cast(zmq.asyncio.Socket, transport.make_socket(
            self._context, zmq.ROUTER, endpoint, bind=True, curve_secret_key=curve_secret_key))
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running: dict[SessionKey, Generation] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def run(self) -> None:
        num_read = 0
        try:
            while True:
                num_read += 1
                if num_read % READER_YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # recv does not yield while messages wait
                frames = await self._socket.recv_multipart(copy=False)
                if len(frames) < 2:
                    continue
                identity = bytes(frames[0].buffer)
                try:
                    message = decode(frames[1:])
                except ProtocolError as exc:
                    logger.warning("dropped malformed client message: %s", exc)
                    continue
                await self._handle(identity, message)
        finally:
            self.close()

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for generation in list(self._running.values()):
            generation.close()
        self._running.clear()
        self._socket.close(0)

    async def _handle(self, identity: bytes, message: object) -> None:
        if isinstance(message, SubmitGeneration):
            await self._submit(identity, message)
        elif isinstance(message, AbortGeneration):
            for client_request_id in message.client_request_ids:
                generation = self._running.get((identity, str(client_request_id)))
                if generation is not None:  # the stream then ends with the "abort" delta
                    self._serving.engine.abort(generation.request_id)
        elif isinstance(message, QueryStats):
            await self._send(identity, self._stats_report(message.query_id))
        else:
            logger.warning("unexpected client message %s", type(message).__name__)

    async def _submit(self, identity: bytes, submit: SubmitGeneration) -> None:
        key = (identity, submit.client_request_id)
        try:
            if key in self._running:
                raise ApiError(f"request id {submit.client_request_id!r} is already running")
            generation, reply = self._start(submit)
        except ApiError as exc:
            await self._send(identity, GenerationChunk(
                submit.client_request_id, np.zeros(0, dtype=np.int32), "",
                finish_reason=FINISH_ERROR, error=exc.message))
            return
        self._running[key] = generation
        task = asyncio.ensure_future(self._pump(key, generation, reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start(self, submit: SubmitGeneration) -> tuple[Generation, ToolReply | None]:
        serving = self._serving
        rules = serving.sampling_rules
        priority = serving.check_priority(submit.priority)
        token_ids, plan, output = self._prompt(submit)
        filled = rules.defaults.apply(submit.sampling, submit.unset_sampling)
        sampling = rules.check_sampling(_constrained(filled, output.structured))
        serving.prompts.max_tokens_for(sampling.max_tokens, len(token_ids))  # the context rule
        stop = rules.stop_strings([str(s) for s in submit.stop])
        serving.check_available()
        serving.log_request("ZMQ", [Prompt(token_ids, submit.prompt or None)], sampling)
        options = output.text_options(
            rules.text_options(sampling, stop, output.show_special_tokens))
        generation = serving.start(token_ids, sampling, options, time.perf_counter(), priority)
        return generation, ToolReply(plan.tool_format) if plan else None

    def _prompt(self, submit: SubmitGeneration) -> tuple[list[int], ToolPlan | None, OutputRules]:
        """The prompt's token ids; with messages and tool_options, the tool plan and its
        constraint too."""
        prompts = self._serving.prompts
        given = [bool(submit.prompt), len(submit.prompt_token_ids) > 0, bool(submit.messages)]
        if sum(given) != 1:
            raise ApiError("give exactly one of prompt, prompt_token_ids and messages")
        if submit.tool_options and not submit.messages:
            raise ApiError("tool_options need messages", param="tool_options")
        if submit.prompt:
            return prompts.encode_text(submit.prompt, submit.add_special_tokens), None, \
                OutputRules()
        if len(submit.prompt_token_ids):
            return prompts.check_token_ids(submit.prompt_token_ids.tolist(),
                                           "prompt_token_ids"), None, OutputRules()
        request = _chat_request(submit)
        plan = tool_plan(request, self._serving.tool_format)
        prompt = chat_prompt(self._serving, request.messages, request.tools,
                             request.add_generation_prompt, describe_tools=plan is not None)
        rules = ReplyRules(plan, self._serving.reasoning, prompt.text)
        return prompt.token_ids, plan, chat_output_rules(self._serving, request, rules)

    async def _pump(self, key: SessionKey, generation: Generation,
                    reply: ToolReply | None) -> None:
        identity, client_request_id = key
        try:
            async for output in generation.outputs():
                chunk = _chunk(client_request_id, generation, output, reply)
                if not await self._send(identity, chunk):
                    return  # the client is gone: `finally` aborts the generation
        except Exception:  # one bad generation must not stop the endpoint
            logger.exception("client generation %s failed", generation.request_id)
        finally:
            generation.close()
            self._running.pop(key, None)

    async def _send(self, identity: bytes, message: object) -> bool:
        try:
            await self._socket.send_multipart([identity, *encode(message)], copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected
            logger.info("client %r unreachable: %s", identity, exc)
            return False
        return True

    def _stats_report(self, query_id: str) -> StatsReport:
        serving = self._serving
        snapshot = serving.engine.stats
        return StatsReport(query_id=query_id, model_name=serving.config.model_name,
                           max_context=serving.config.max_context,
                           healthy=serving.engine.is_healthy(),
                           problems=serving.engine.health_problems(),
                           stats=dict(snapshot.stats) if snapshot else {},
                           workers=list(snapshot.workers) if snapshot else [],
                           num_in_flight=serving.engine.num_in_flight)


def _chat_request(submit: SubmitGeneration) -> ChatCompletionRequest:
    """The messages, and tool options, read as a chat request's (the same checks as HTTP)."""
    try:
        options = orjson.loads(submit.tool_options) if submit.tool_options else {}
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"tool_options is not JSON: {exc}", param="tool_options") from None
    if not isinstance(options, dict) or set(options) - set(TOOL_OPTIONS):
        raise ApiError(f"tool_options must be an object with keys among {list(TOOL_OPTIONS)}",
                       param="tool_options")
    try:
        return ChatCompletionRequest.model_validate({"messages": submit.messages, **options})
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def _constrained(sampling: SamplingParams, structured: StructuredOutput | None) -> SamplingParams:
    """The client's own constraint (checked here, as the HTTP fields are), or the tools'."""
    if structured is None:
        if sampling.structured is not None:  # a JSON Schema compiles best effort
            own = planned(Constraint(sampling.structured, "sampling.structured"))
            return dataclasses.replace(sampling, structured=own.structured)
        return sampling
    if sampling.structured is not None:
        raise ApiError("a request takes one output constraint; got tool_options and "
                       "sampling.structured", param="sampling.structured")
    return dataclasses.replace(sampling, structured=structured)


def _chunk(client_request_id: str, generation: Generation, output: GenerationOutput,
           reply: ToolReply | None) -> GenerationChunk:
    text, finish_reason, tool_calls = output.text, output.finish_reason, []
    if reply is not None:
        parsed = reply.add(output.text, output.finish_reason)
        text, finish_reason = parsed.content, reply.finish_reason(output.finish_reason)
        tool_calls = [delta.to_openai() for delta in parsed.tool_calls]
    arrays = {}
    if output.logprobs:
        width = max(len(entry.top) for entry in output.logprobs)
        top_ids = np.full((len(output.logprobs), width), -1, dtype=np.int32)
        top_lps = np.full((len(output.logprobs), width), -np.inf, dtype=np.float32)
        for row, entry in enumerate(output.logprobs):
            for col, (token_id, logprob) in enumerate(entry.top):
                top_ids[row, col], top_lps[row, col] = token_id, logprob
        arrays = {"logprobs": np.asarray([e.logprob for e in output.logprobs], dtype=np.float32),
                  "top_logprob_ids": top_ids, "top_logprobs": top_lps}
    return GenerationChunk(client_request_id=client_request_id,
                           token_ids=np.asarray(output.token_ids, dtype=np.int32),
                           text=text, finish_reason=finish_reason, tool_calls=tool_calls,
                           num_prompt_tokens=generation.num_prompt_tokens,
                           num_cached_tokens=generation.num_cached_tokens,
                           error=output.error, **arrays)
