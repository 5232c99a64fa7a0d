"""The SSE response of a streamed completion or chat completion, written once for both.

`stream_choices` runs the choices' outputs as server-sent events: opening chunks, one chunk
per output in arrival order, an error event if a choice fails, the usage chunk when asked,
then `[DONE]`; when the response ends early (client gone) every choice is aborted.
Owns: event framing and that order. Does not own: chunk shapes (ChoiceChunks, per route).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import orjson

from justapi.frontend.choices import close_all, fan_in
from justapi.frontend.errors import SERVER_ERROR, error_body
from justapi.frontend.generation import Generation, GenerationOutput
from justapi.wire.protocol import FINISH_ERROR

SSE_DONE = b"data: [DONE]\n\n"


class ChoiceChunks(Protocol):
    """What a route puts in a chunk's `choices` entry."""

    def opening(self, index: int) -> dict | None:
        """The choice's first chunk before any output (chat: the role), or None for none."""

    def delta(self, index: int, output: GenerationOutput) -> dict | None:
        """The choice's chunk for one output (None: nothing to show yet, e.g. tokens whose
        text is held back as a partial character). Every output comes here, so a reader of
        the tokens (thinking tokens are counted by id) sees them all."""


def sse_event(payload: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_sse_event(name: str, payload: dict) -> bytes:
    """One server-sent event with an `event:` name (the Responses and Anthropic streams)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


async def stream_choices(generations: Sequence[Generation], chunks: ChoiceChunks, header: dict,
                         usage_of: Callable[[], dict],
                         include_usage: bool) -> AsyncIterator[bytes]:
    """Every chunk is `header` + one choice (+ `"usage": null` when the usage chunk follows);
    usage_of: the usage once every choice ended."""
    extra = {"usage": None} if include_usage else {}

    def event(choice: dict) -> bytes:
        return sse_event({**header, "choices": [choice], **extra})

    try:
        for index in range(len(generations)):
            opening = chunks.opening(index)
            if opening is not None:
                yield event(opening)
        async for index, output in fan_in(generations):
            if output.finish_reason == FINISH_ERROR:
                yield sse_event(error_body(f"generation failed: {output.error}", SERVER_ERROR))
                break
            choice = chunks.delta(index, output)  # None: text still held back
            if choice is not None:
                yield event(choice)
        if include_usage:
            yield sse_event({**header, "choices": [], "usage": usage_of()})
        yield SSE_DONE
    finally:
        close_all(generations)
