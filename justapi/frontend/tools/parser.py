"""Generated text -> message content and OpenAI tool calls, incrementally, for one choice.

Feed the text as it is generated: each `feed` returns the content and the `tool_calls`
deltas it adds, in OpenAI's streaming shape. A call goes out whole, once its arguments close
(one delta: index, id, type, name and arguments, the model's raw JSON text), so no client is
ever handed part of a call. The whole reply is parsed by the same code, so a stream and a full
response agree call for call. Text before the format's trigger is content (whitespace around
calls is dropped). A reply that ends inside a call (cut by max_tokens, or ended at a repeated
call) keeps its complete calls and drops the unfinished one; a call region that does not parse
is returned as text. Owns: that parse. Does not own: the formats (formats.py) or response
shapes (serving_chat.py).
"""
from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from justapi.frontend.tools.formats import ToolFormat, split_pieces
from justapi.frontend.tools.json_scan import WHITESPACE, MalformedJson, ObjectScanner
from justapi.frontend.tools.tagged_scan import TaggedCallScanner
from justapi.wire.protocol import FINISH_LENGTH, FINISH_STOP

ARGUMENT_KEYS = ("arguments", "parameters")
FINISH_TOOL_CALLS = "tool_calls"
"""OpenAI's finish_reason of a reply that called tools and ended by itself."""
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text of the arguments, as the model wrote them."""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    """Set on a call's first delta only, with its name."""
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id(length: int = 0) -> str:
    """OpenAI's `call_` + 24 characters, or `length` letters and digits (Mistral: 9)."""
    size = length or 24
    token = "".join(secrets.choice(_ID_ALPHABET) for _ in range(size))
    return token if length else f"call_{token}"


class _Phase(Enum):
    TEXT = 0      # content, watching for the trigger
    PIECES = 1    # literal pieces of the format
    OBJECT = 2    # one call object
    AFTER = 3     # after a call: another one, the closer, or the end
    RAW = 4       # plain text from here on (a malformed call region, or no call can start)


class ToolCallParser:
    """One choice's reply, fed as it grows; `finish()` once it ended."""

    def __init__(self, tool_format: ToolFormat,
                 new_id: Callable[[int], str] = new_call_id) -> None:
        self.format = tool_format
        self.calls: list[ToolCall] = []
        self.is_malformed = False
        """A call region did not parse: its text went out as content."""
        self.is_cut = False
        """The reply ended inside a call: that call's text was dropped."""
        self._new_id = new_id
        self._pending = ""           # text not consumed yet
        self._region: list[str] = []  # text of the current call region (for RAW)
        self._phase = _Phase.TEXT
        self._pieces: tuple[str, ...] = ()
        self._then = _Phase.OBJECT   # the phase after the pieces
        self._scanner: ObjectScanner | TaggedCallScanner = ObjectScanner()
        self._num_region_calls = 0   # calls completed in the current region
        self._out = ParsedDelta()

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        self._out = ParsedDelta()
        try:
            while self._pending and self._advance():
                pass
        except MalformedJson:
            self._to_raw()
        return self._out

    def finish(self, finish_reason: str = "") -> ParsedDelta:
        """The end of the reply: held-back text as content; a call left open dropped (and,
        when max_tokens cut the reply, held text that was the start of the trigger)."""
        self._out = ParsedDelta()
        if self._phase is _Phase.TEXT:
            held = self._pending.strip(WHITESPACE)
            if finish_reason == FINISH_LENGTH and held and self.format.trigger.startswith(held):
                self.is_cut = True
            elif not self.calls or held:
                self._out.content += self._pending
        elif self._phase is not _Phase.RAW and self._is_cut_in_call():
            self.is_cut = True
        self._pending = ""
        self._region = []
        return self._out

    def _is_cut_in_call(self) -> bool:
        """At the end: inside a call object, or before the region's first one. (Closing
        pieces left out after complete calls are forgiven, as vLLM's parsers do.)"""
        if self._phase is _Phase.OBJECT and (self._scanner.has_started or self._pending):
            return True
        return self._num_region_calls == 0

    # ---------------------------------------------------------------- phases
    def _advance(self) -> bool:
        """Consume what the current phase can; False when it needs more text."""
        if self._phase is _Phase.TEXT:
            return self._text()
        if self._phase is _Phase.RAW:
            self._out.content += self._pending
            self._pending = ""
            return False
        before, num_calls = self._pending, len(self.calls)
        try:
            if self._phase is _Phase.PIECES:
                return self._match_pieces()
            if self._phase is _Phase.OBJECT:
                return self._object()
            return self._after_call()
        finally:  # keep the region's text (a call that ended took its own along)
            if len(self.calls) == num_calls:
                self._region.append(before[:len(before) - len(self._pending)])

    def _text(self) -> bool:
        trigger = self.format.trigger
        if self.format.is_start_only:
            return self._start_only_text()
        start = self._pending.find(trigger)
        if start < 0:
            keep = _held_back(self._pending, trigger)
            self._out.content += self._pending[:keep]
            self._pending = self._pending[keep:]
            return False
        self._enter_calls(start)
        return True

    def _start_only_text(self) -> bool:
        """A format that calls only at the reply's start: the trigger there, or plain text."""
        text = self._pending.lstrip(WHITESPACE)
        if text.startswith(self.format.trigger):
            self._enter_calls(len(self._pending) - len(text))
            return True
        if not self.format.trigger.startswith(text):
            self._phase = _Phase.RAW
            return True
        return False  # whitespace, or the trigger's start: not decided yet

    def _enter_calls(self, start: int) -> None:
        """The trigger starts at `start` of the pending text."""
        trigger = self.format.trigger
        self._out.content += self._pending[:start].rstrip(WHITESPACE)
        cut = start if self.format.keeps_trigger else start + len(trigger)
        self._region = [] if self.format.keeps_trigger else [trigger]
        self._num_region_calls = 0
        self._pending = self._pending[cut:]
        self._expect(self.format.opener, _Phase.OBJECT)

    def _expect(self, pieces: tuple[str, ...], then: _Phase) -> None:
        self._pieces = split_pieces(pieces)
        self._then = then
        self._phase = _Phase.PIECES

    def _match_pieces(self) -> bool:
        text = self._pending.lstrip(WHITESPACE)
        while self._pieces:
            piece = self._pieces[0]
            if not text.startswith(piece):
                if piece.startswith(text):
                    self._pending = text
                    return False  # a piece not complete yet
                raise MalformedJson(f"expected {piece!r}")
            text = text[len(piece):].lstrip(WHITESPACE)
            self._pieces = self._pieces[1:]
        self._pending = text
        self._phase = self._then
        if self._then is _Phase.OBJECT:
            self._scanner = self._new_scanner()
        return True

    def _new_scanner(self) -> ObjectScanner | TaggedCallScanner:
        if self.format.args_marker:
            return TaggedCallScanner(self.format.args_marker, self.format.id_marker)
        return ObjectScanner()

    def _object(self) -> bool:
        scanner = self._scanner
        read = scanner.feed(self._pending)
        self._pending = self._pending[read:]
        if not scanner.is_done:
            return False
        self._end_call()
        self._expect(self.format.after_call, _Phase.AFTER)
        return True

    def _after_call(self) -> bool:
        text = self._pending.lstrip(WHITESPACE)
        self._pending = text
        between = split_pieces(self.format.between)
        closer = split_pieces(self.format.closer)
        if not text:
            return False
        if between and self.format.is_parallel and _opens(text, between[0]):
            if not text.startswith(between[0]):
                return False
            self._expect(self.format.between, _Phase.OBJECT)
        elif closer and _opens(text, closer[0]):
            self._expect(self.format.closer, _Phase.TEXT)
        elif closer:
            raise MalformedJson(f"expected {closer[0]!r}")
        else:  # the calls are over: text follows (a start-only format calls no more)
            self._phase = _Phase.RAW if self.format.is_start_only else _Phase.TEXT
        return True

    # ---------------------------------------------------------------- one call
    def _end_call(self) -> None:
        """The call's arguments closed: it goes out whole, in one delta."""
        values = self._scanner.values
        name = _string_value(values.get("name"))
        if name is None:
            raise MalformedJson("a tool call without a name")
        call_id = _string_value(values.get("id")) or self._new_id(self.format.id_length)
        call = ToolCall(call_id, name, _call_arguments(values))
        self._out.tool_calls.append(ToolCallDelta(len(self.calls), call.id, call.name,
                                                  call.arguments))
        self.calls.append(call)
        self._num_region_calls += 1
        self._region = []

    def _to_raw(self) -> None:
        """The call region is not a call: its text (from the end of its last complete call),
        and all that follows, is content."""
        self.is_malformed = True
        self._out.content += "".join(self._region) + self._pending
        self._pending = ""
        self._region = []
        self._phase = _Phase.RAW


def _held_back(text: str, trigger: str) -> int:
    """Where the content that may go out ends: before whitespace at the end and before an
    ending that could still become the trigger."""
    keep = len(text)
    for size in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-size:]):
            keep = len(text) - size
            break
    return len(text[:keep].rstrip(WHITESPACE))


def _opens(text: str, piece: str) -> bool:
    return text.startswith(piece) or piece.startswith(text)


def _string_value(raw: str | None) -> str | None:
    if raw is None or not raw.startswith('"'):
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _call_arguments(values: dict[str, str]) -> str:
    """The arguments' JSON text; a model that wrote them as a JSON string gets it decoded."""
    raw = next((values[key] for key in ARGUMENT_KEYS if key in values), "{}")
    if raw.startswith('"'):
        return _string_value(raw) or ""
    return raw


class ToolReply:
    """One choice's reply as it streams: each output's text -> its content and tool call
    deltas; and the finish reason the reply ends with."""

    def __init__(self, tool_format: ToolFormat) -> None:
        self.parser = ToolCallParser(tool_format)

    def add(self, text: str, finish_reason: str = "") -> ParsedDelta:
        parsed = self.parser.feed(text)
        if finish_reason:
            tail = self.parser.finish(finish_reason)
            parsed = ParsedDelta(parsed.content + tail.content, parsed.tool_calls + tail.tool_calls)
        return parsed

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" for a reply that called and ended by itself (stop), else `reason`."""
        parser = self.parser
        return FINISH_TOOL_CALLS if reason == FINISH_STOP and parser.calls \
            and not parser.is_malformed else reason


def parse_reply(tool_format: ToolFormat, text: str,
                finish_reason: str = "") -> tuple[str | None, list[ToolCall]]:
    """A whole reply -> (content, calls): content None when the reply is calls only; a reply
    whose calls do not parse is all content; one cut inside a call keeps its complete calls
    (its content: the text before them)."""
    parser = ToolCallParser(tool_format)
    content = parser.feed(text).content + parser.finish(finish_reason).content
    if parser.is_malformed or not (parser.calls or parser.is_cut):
        return text, []
    return content or None, parser.calls
