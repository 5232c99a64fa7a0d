"""A reply as a sequence of blocks: its thinking, runs of answer text, and each tool call, in
the order they were written; for the APIs whose output is such blocks (/v1/responses output
items, /v1/messages content blocks).

Feed ReplyDeltas; each call returns what happened to the blocks (opened, grew, closed), so a
stream writes its events from them, and a whole response is the same blocks fed at once. A
block of text starts at its first character that is not whitespace (the newlines a model
writes after its thinking open no block). Owns: those blocks.
Does not own: reading the reply (reply.py) or any response shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from justapi.frontend.generation import GenerationOutput
from justapi.frontend.reply import ReplyDelta, ReplyReader


class SegmentKind(Enum):
    REASONING = "reasoning"
    TEXT = "text"
    TOOL_CALL = "tool_call"


class EventKind(Enum):
    OPEN = "open"
    DELTA = "delta"
    CLOSE = "close"


@dataclass
class Segment:
    """One block: its kind, its position among the reply's blocks, and its text so far (a
    call's arguments, JSON text)."""

    kind: SegmentKind
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass
class SegmentEvent:
    kind: EventKind
    segment: Segment
    delta: str = ""


class Segmenter:
    """One reply's blocks; `add` each delta, then `finish` once."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    @property
    def _open(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def add(self, delta: ReplyDelta) -> list[SegmentEvent]:
        events: list[SegmentEvent] = []
        if delta.reasoning:
            self._append(SegmentKind.REASONING, delta.reasoning, events)
        if delta.content:
            self._add_text(delta.content, events)
        for call in delta.tool_calls:
            if call.id is not None:
                self._start(Segment(SegmentKind.TOOL_CALL, len(self.segments),
                                    call_id=call.id, name=call.name or ""), events)
            if call.arguments:
                self._append(SegmentKind.TOOL_CALL, call.arguments, events)
        return events

    def finish(self) -> list[SegmentEvent]:
        """Close the last block."""
        last = self._open
        return [] if last is None else [SegmentEvent(EventKind.CLOSE, last)]

    def _add_text(self, text: str, events: list[SegmentEvent]) -> None:
        last = self._open
        if last is None or last.kind is not SegmentKind.TEXT:
            text = text.lstrip()
            if not text:
                return
        self._append(SegmentKind.TEXT, text, events)

    def _append(self, kind: SegmentKind, text: str, events: list[SegmentEvent]) -> None:
        last = self._open
        if last is None or last.kind is not kind:
            last = Segment(kind, len(self.segments))
            self._start(last, events)
        last.text += text
        events.append(SegmentEvent(EventKind.DELTA, last, text))

    def _start(self, segment: Segment, events: list[SegmentEvent]) -> None:
        last = self._open
        if last is not None:
            events.append(SegmentEvent(EventKind.CLOSE, last))
        self.segments.append(segment)
        events.append(SegmentEvent(EventKind.OPEN, segment))


def whole_segments(reader: ReplyReader, output: GenerationOutput) -> list[Segment]:
    """A whole output's blocks, read as its stream would be (`reader` then holds the reply's
    finish reason and thinking tokens)."""
    segmenter = Segmenter()
    segmenter.add(reader.add(output))
    segmenter.finish()
    return segmenter.segments
