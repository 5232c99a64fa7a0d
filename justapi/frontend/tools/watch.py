"""A tool reply's watch over its generation: it ends a reply that repeats a call, and judges
the calls against their tools' own parameter schemas once the reply is over.

A small model that has made a call often writes the same call again and again until
max_tokens. Once a call identical to an earlier one of the same reply (same name, same
arguments as JSON values) is complete, the generation ends ("stop", so the reply's finish
reason is "tool_calls") and the repeat is never shown: text after a complete call is held
back until the next call completes and is found new. Owns: that rule and the calls' judgement.
Does not own: the parse (parser.py), the counters (justapi/frontend/structured_replies.py).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from justapi.frontend.structured_replies import StructuredMetrics
from justapi.frontend.tools.formats import ToolFormat
from justapi.frontend.tools.parser import ToolCall, ToolCallParser
from justapi.structured.validation import json_violation
from justapi.wire.protocol import FINISH_LENGTH, FINISH_STOP


@dataclass(frozen=True)
class ToolSchema:
    """A tool's own parameters schema (JSON text) and whether it was strict."""

    schema_text: str
    is_strict: bool


class ToolCallWatch:
    """One choice's watch (justapi.frontend.generation.OutputWatch)."""

    can_end = True

    def __init__(self, tool_format: ToolFormat, tools: Mapping[str, ToolSchema],
                 metrics: StructuredMetrics | None, is_required: bool) -> None:
        self._parser = ToolCallParser(tool_format, new_id=lambda _: "")
        self._tools = tools
        self._metrics = metrics
        self._is_required = is_required
        self.calls: list[ToolCall] = []
        """The calls shown, in order (a repeat that ended the reply is not one of them)."""
        self._seen: set[tuple[str, str]] = set()
        self._held: list[str] = []
        self._has_ended = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Read character by character, so a call's end is found at its exact character."""
        if self._has_ended:
            return "", True
        out: list[str] = []
        parser = self._parser
        for char in text:
            num_calls = len(parser.calls)
            parser.feed(char)
            if len(parser.calls) == num_calls:
                (self._held if self.calls else out).append(char)
                continue
            call = parser.calls[-1]
            key = (call.name, _canonical(call.arguments))
            if key in self._seen:
                self._has_ended = True
                self._held = []
                return "".join(out), True
            self._seen.add(key)
            self.calls.append(call)
            out += self._held
            out.append(char)
            self._held = []
        return "".join(out), False

    def flush(self) -> str:
        held, self._held = "".join(self._held), []
        return held

    def finished(self, finish_reason: str) -> None:
        if self._metrics is None or finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            return
        if not self.calls:
            if self._is_required:
                self._metrics.count_reply("tool_calls", False, "no call was completed",
                                          "tools")
            return
        violations = [self._violation(call) for call in self.calls]
        first = next((v for v in violations if v), "")
        is_strict = all(self._tools.get(call.name, ToolSchema("", False)).is_strict
                        for call in self.calls)
        self._metrics.count_reply("tool_calls", is_strict, first, "tools")

    def _violation(self, call: ToolCall) -> str:
        tool = self._tools.get(call.name)
        if tool is None:
            return f"{call.name}: not one of the request's tools"
        violation = json_violation(tool.schema_text, call.arguments)
        return f"{call.name}: {violation}" if violation else ""


def _canonical(arguments: str) -> str:
    """Arguments as comparable JSON (key order and spacing aside)."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments
