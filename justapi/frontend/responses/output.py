"""/v1/responses: the request through the chat path, its reply as Response output items,
whole or streamed.

Each block of the reply (segments.py) is an output item: the thinking a `reasoning` item (its
text as `reasoning_text` content), answer text a `message` with one `output_text` part, each
tool call a `function_call`. A reply cut by max_output_tokens is an `incomplete` response. The
stream is the documented sequence: response.created, response.in_progress, then per item
output_item.added, content_part.added, its deltas (reasoning_text / output_text /
function_call_arguments), their .done events, output_item.done, and last response.completed
(or .incomplete, or .failed); every event numbered by sequence_number. Owns: those shapes.
Does not own: the translation (translate.py) or reading the reply (reply.py, segments.py).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from justapi.frontend.choices import close_all, collect_choices, fan_in
from justapi.frontend.errors import renaming
from justapi.frontend.responses.models import ResponsesRequest
from justapi.frontend.responses.translate import RENAMES, chat_request
from justapi.frontend.segments import (
    EventKind,
    Segment,
    SegmentEvent,
    Segmenter,
    SegmentKind,
    whole_segments,
)
from justapi.frontend.serving import Serving
from justapi.frontend.serving_chat import ChatRun, start_chat
from justapi.frontend.sse import named_sse_event
from justapi.wire.protocol import FINISH_ERROR, FINISH_LENGTH

ITEM_PREFIX = {SegmentKind.REASONING: "rs", SegmentKind.TEXT: "msg", SegmentKind.TOOL_CALL: "fc"}


async def create_response(serving: Serving, request: ResponsesRequest,
                          arrival_s: float) -> dict | AsyncIterator[bytes]:
    """A whole Response, or (stream=True) its events."""
    with renaming(RENAMES):
        run = start_chat(serving, chat_request(request), arrival_s)
    shape = ResponseShape(serving, request, run)
    if request.stream:
        return stream_response(shape)
    with renaming(RENAMES):
        [output] = await collect_choices(serving, run.generations, run.output)
    reader = run.rules.reader()
    segments = whole_segments(reader, output)
    shape.reasoning_tokens = reader.reasoning_tokens
    return shape.response(shape.status(output.finish_reason), segments)


class ResponseShape:
    """One response's fields, item ids and usage."""

    def __init__(self, serving: Serving, request: ResponsesRequest, run: ChatRun) -> None:
        self.request = request
        self.run = run
        self.id = serving.new_id("resp")
        self.created_at = int(time.time())
        self.model = serving.config.model_name
        self.reasoning_tokens = 0
        self._serving = serving
        self._item_ids: dict[int, str] = {}

    def status(self, finish_reason: str) -> str:
        return "incomplete" if finish_reason == FINISH_LENGTH else "completed"

    def item_id(self, segment: Segment) -> str:
        if segment.index not in self._item_ids:
            self._item_ids[segment.index] = self._serving.new_id(ITEM_PREFIX[segment.kind])
        return self._item_ids[segment.index]

    def item(self, segment: Segment, status: str = "completed") -> dict[str, Any]:
        """The output item of a block (so far)."""
        base = {"id": self.item_id(segment), "status": status}
        if segment.kind is SegmentKind.REASONING:
            return {**base, "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": segment.text}]}
        if segment.kind is SegmentKind.TEXT:
            return {**base, "type": "message", "role": "assistant",
                    "content": [output_text(segment.text)]}
        return {**base, "type": "function_call", "call_id": segment.call_id,
                "name": segment.name, "arguments": segment.text}

    def response(self, status: str, segments: list[Segment],
                 error: dict[str, str] | None = None) -> dict[str, Any]:
        request = self.request
        is_final = status not in ("in_progress",)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model,
            "output": [self.item(s) for s in segments], "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": request.instructions, "metadata": request.metadata or {},
            "max_output_tokens": request.max_output_tokens,
            "parallel_tool_calls": request.parallel_tool_calls,
            "temperature": request.temperature, "top_p": request.top_p,
            "tool_choice": _dump(request.tool_choice) or "auto",
            "tools": [_dump(tool) for tool in request.tools or []],
            "text": {"format": _dump(request.text.format) if request.text and request.text.format
                     else {"type": "text"}},
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None,
                          "summary": None},
            "store": False, "previous_response_id": None, "truncation": "disabled",
            "user": request.user, "usage": self.usage() if is_final else None,
            "completed_at": int(time.time()) if status == "completed" else None,
        }

    def usage(self) -> dict[str, Any]:
        generation = self.run.generations[0]
        num_input, num_output = self.run.num_prompt_tokens, generation.num_output_tokens
        return {"input_tokens": num_input,
                "input_tokens_details": {"cached_tokens": generation.num_cached_tokens},
                "output_tokens": num_output,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": num_input + num_output}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _dump(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    return value.model_dump(exclude_none=True, by_alias=True)


async def stream_response(shape: ResponseShape) -> AsyncIterator[bytes]:
    """The response's events, numbered; the choices are aborted if the stream ends early."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        return named_sse_event(kind, {"type": kind, "sequence_number": next(numbers), **fields})

    generations = shape.run.generations
    reader, segmenter = shape.run.rules.reader(), Segmenter()
    finish_reason = ""
    try:
        yield event("response.created", response=shape.response("in_progress", []))
        yield event("response.in_progress", response=shape.response("in_progress", []))
        async for _, output in fan_in(generations):
            if output.finish_reason == FINISH_ERROR:
                error = {"code": "server_error", "message": f"generation failed: {output.error}"}
                yield event("response.failed",
                            response=shape.response("failed", segmenter.segments, error))
                return
            for change in segmenter.add(reader.add(output)):
                for kind, fields in item_events(shape, change):
                    yield event(kind, **fields)
            finish_reason = output.finish_reason or finish_reason
        for change in segmenter.finish():
            for kind, fields in item_events(shape, change):
                yield event(kind, **fields)
        shape.reasoning_tokens = reader.reasoning_tokens
        status = shape.status(finish_reason)
        yield event(f"response.{status}", response=shape.response(status, segmenter.segments))
    finally:
        close_all(generations)


Events = list[tuple[str, dict[str, Any]]]


def item_events(shape: ResponseShape, change: SegmentEvent) -> Events:
    """The events of one change to a block (its output item)."""
    segment = change.segment
    where = {"item_id": shape.item_id(segment), "output_index": segment.index}
    if change.kind is EventKind.OPEN:
        return _opened(shape, segment, where)
    if segment.kind is SegmentKind.TOOL_CALL:
        if change.kind is EventKind.DELTA:
            return [("response.function_call_arguments.delta", {**where, "delta": change.delta})]
        return [("response.function_call_arguments.done",
                 {**where, "name": segment.name, "arguments": segment.text}),
                ("response.output_item.done", {"output_index": segment.index,
                                               "item": shape.item(segment)})]
    name, extra = _text_event(segment.kind)
    if change.kind is EventKind.DELTA:
        return [(f"response.{name}.delta", {**where, "content_index": 0, "delta": change.delta,
                                            **extra})]
    return [(f"response.{name}.done", {**where, "content_index": 0, "text": segment.text,
                                       **extra}),
            ("response.content_part.done", {**where, "content_index": 0,
                                            "part": _part(segment.kind, segment.text)}),
            ("response.output_item.done", {"output_index": segment.index,
                                           "item": shape.item(segment)})]


def _opened(shape: ResponseShape, segment: Segment, where: dict[str, Any]) -> Events:
    added = shape.item(segment, "in_progress")
    events: Events = [("response.output_item.added", {"output_index": segment.index,
                                                      "item": added})]
    if segment.kind is not SegmentKind.TOOL_CALL:  # its one content part, empty
        added["content"] = []
        events.append(("response.content_part.added", {**where, "content_index": 0,
                                                       "part": _part(segment.kind, "")}))
    return events


def _text_event(kind: SegmentKind) -> tuple[str, dict[str, Any]]:
    """The event name of a block's text, and the fields only output text has."""
    if kind is SegmentKind.REASONING:
        return "reasoning_text", {}
    return "output_text", {"logprobs": []}


def _part(kind: SegmentKind, text: str) -> dict[str, Any]:
    if kind is SegmentKind.REASONING:
        return {"type": "reasoning_text", "text": text}
    return output_text(text)
