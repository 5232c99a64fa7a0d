"""/v1/messages: the request through the chat path, its reply as Anthropic content blocks,
whole or streamed; and /v1/messages/count_tokens.

Each block of the reply (segments.py) is a content block: the thinking a `thinking` block
(with an empty signature: nothing is signed here), answer text a `text` block, each tool call
a `tool_use` block (arguments parsed into `input`). stop_reason: end_turn, stop_sequence (with
the string), max_tokens, or tool_use. The stream is Anthropic's: message_start, per block
content_block_start / content_block_delta (thinking_delta, text_delta, input_json_delta) /
content_block_stop, then message_delta (stop reason, usage) and message_stop; a failure is an
`error` event. Usage counts prompt tokens served from the prefix cache as
cache_read_input_tokens, the rest as input_tokens. Owns: those shapes. Does not own: the
translation (translate.py) or reading the reply (reply.py, segments.py).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from justapi.frontend.choices import close_all, collect_choices, fan_in
from justapi.frontend.errors import renaming
from justapi.frontend.messages.models import CountTokensRequest, MessagesRequest
from justapi.frontend.messages.translate import RENAMES, chat_request
from justapi.frontend.segments import (
    EventKind,
    Segment,
    SegmentEvent,
    Segmenter,
    SegmentKind,
    whole_segments,
)
from justapi.frontend.serving import Serving
from justapi.frontend.serving_chat import ChatRun, request_prompt, start_chat
from justapi.frontend.sse import named_sse_event
from justapi.frontend.tools.request import tool_plan
from justapi.wire.protocol import FINISH_ERROR, FINISH_LENGTH

DELTA_TYPES = {SegmentKind.REASONING: ("thinking_delta", "thinking"),
               SegmentKind.TEXT: ("text_delta", "text"),
               SegmentKind.TOOL_CALL: ("input_json_delta", "partial_json")}


def count_tokens(serving: Serving, request: CountTokensRequest) -> dict[str, int]:
    """The prompt's length, rendered as the same messages request would be."""
    with renaming(RENAMES):
        chat = chat_request(request)
        serving.check_model(chat.model)
        prompt = request_prompt(serving, chat, tool_plan(chat, serving.tool_format))
    return {"input_tokens": len(prompt.token_ids)}


async def create_message(serving: Serving, request: MessagesRequest,
                         arrival_s: float) -> dict | AsyncIterator[bytes]:
    """A whole message, or (stream=True) its events."""
    with renaming(RENAMES):
        run = start_chat(serving, chat_request(request), arrival_s)
    shape = MessageShape(serving.new_id("msg"), serving.config.model_name, run)
    if request.stream:
        return stream_message(shape)
    with renaming(RENAMES):
        [output] = await collect_choices(serving, run.generations, run.output)
    reader = run.rules.reader()
    segments = whole_segments(reader, output)
    shape.thinking_tokens = reader.reasoning_tokens
    stop_reason = shape.stop_reason(reader.finish_reason(output.finish_reason))
    return {**shape.message([block(s) for s in segments], stop_reason),
            "usage": shape.usage()}


class MessageShape:
    """One message's fields and usage."""

    def __init__(self, message_id: str, model: str, run: ChatRun) -> None:
        self.id = message_id
        self.model = model
        self.run = run
        self.thinking_tokens = 0

    def message(self, content: list[dict[str, Any]], stop_reason: str | None) -> dict[str, Any]:
        stop = self.run.generations[0].matched_stop if stop_reason == "stop_sequence" else None
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop}

    def stop_reason(self, finish_reason: str) -> str:
        if finish_reason == FINISH_LENGTH:
            return "max_tokens"
        if finish_reason == "tool_calls":
            return "tool_use"
        return "stop_sequence" if self.run.generations[0].matched_stop else "end_turn"

    def usage(self) -> dict[str, Any]:
        generation = self.run.generations[0]
        cached = generation.num_cached_tokens
        return {"input_tokens": self.run.num_prompt_tokens - cached,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
                "output_tokens": generation.num_output_tokens,
                "output_tokens_details": {"thinking_tokens": self.thinking_tokens}}


def block(segment: Segment, is_open: bool = False) -> dict[str, Any]:
    """The content block of a segment (as it starts, when is_open)."""
    if segment.kind is SegmentKind.REASONING:
        return {"type": "thinking", "thinking": "" if is_open else segment.text, "signature": ""}
    if segment.kind is SegmentKind.TEXT:
        return {"type": "text", "text": "" if is_open else segment.text}
    return {"type": "tool_use", "id": segment.call_id, "name": segment.name,
            "input": {} if is_open else _arguments(segment.text)}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:  # a call cut off by max_tokens
        return {}


async def stream_message(shape: MessageShape) -> AsyncIterator[bytes]:
    def event(kind: str, **fields: Any) -> bytes:
        return named_sse_event(kind, {"type": kind, **fields})

    generations = shape.run.generations
    reader, segmenter = shape.run.rules.reader(), Segmenter()
    finish_reason = ""
    start_usage = {**shape.usage(), "output_tokens": 0}
    try:
        yield event("message_start", message={**shape.message([], None), "usage": start_usage})
        async for _, output in fan_in(generations):
            if output.finish_reason == FINISH_ERROR:
                yield event("error", error={"type": "api_error",
                                            "message": f"generation failed: {output.error}"})
                return
            for change in segmenter.add(reader.add(output)):
                yield block_event(change, event)
            finish_reason = output.finish_reason or finish_reason
        for change in segmenter.finish():
            yield block_event(change, event)
        shape.thinking_tokens = reader.reasoning_tokens
        stop_reason = shape.stop_reason(reader.finish_reason(finish_reason))
        stop = shape.message([], stop_reason)
        yield event("message_delta", delta={"stop_reason": stop_reason,
                                            "stop_sequence": stop["stop_sequence"]},
                    usage=shape.usage())
        yield event("message_stop")
    finally:
        close_all(generations)


def block_event(change: SegmentEvent, event: Any) -> bytes:
    segment = change.segment
    if change.kind is EventKind.OPEN:
        return event("content_block_start", index=segment.index,
                     content_block=block(segment, is_open=True))
    if change.kind is EventKind.DELTA:
        kind, key = DELTA_TYPES[segment.kind]
        return event("content_block_delta", index=segment.index,
                     delta={"type": kind, key: change.delta})
    return event("content_block_stop", index=segment.index)
