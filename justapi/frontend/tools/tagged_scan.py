"""One tool call written as a name, markers and an arguments object, read a character at a
time: Mistral's v11 templates write `name[ARGS]{...}` after each `[TOOL_CALLS]` (Mistral
Small 3.2: `name[CALL_ID]abc123XYZ[ARGS]{...}`).

Reads like ObjectScanner (json_scan.py) and records the same `values` (`name` as JSON text,
`arguments` raw, `id` when the model wrote one), so the parser treats both shapes alike.
Owns: that scan. Does not own: the markers (formats.py) or what a call is (parser.py).
"""
from __future__ import annotations

import json
from enum import Enum

from justapi.frontend.tools.json_scan import WHITESPACE, MalformedJson, ObjectScanner

NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class _State(Enum):
    NAME = 0
    MARKER = 1
    ID = 2
    ARGUMENTS = 3
    DONE = 4


class TaggedCallScanner:
    """Feed text until `is_done`; `values` then holds name, arguments (and id)."""

    def __init__(self, args_marker: str, id_marker: str = "") -> None:
        self.values: dict[str, str] = {}
        self._args_marker = args_marker
        self._id_marker = id_marker
        self._state = _State.NAME
        self._name: list[str] = []
        self._id: list[str] = []
        self._marker = ""
        self._has_id = False
        self._arguments = ObjectScanner()
        self._raw: list[str] = []

    @property
    def has_started(self) -> bool:
        return bool(self._name) or self._state is not _State.NAME

    @property
    def is_done(self) -> bool:
        return self._state is _State.DONE

    def feed(self, text: str) -> int:
        """Read text until the call's arguments close; return how many characters were read."""
        index = 0
        while index < len(text) and self._state is not _State.DONE:
            if self._state is _State.ARGUMENTS:
                index += self._read_arguments(text[index:])
            else:
                self._step(text[index])
                index += 1
        return index

    def _step(self, char: str) -> None:
        if self._state is _State.MARKER:
            self._marker_char(char)
        elif char == "[":
            self._marker = char
            self._state = _State.MARKER
        elif self._state is _State.ID:
            self._id.append(char)
        elif char in WHITESPACE and not self._name:
            return
        elif char in NAME_CHARS:
            self._name.append(char)
        else:
            raise MalformedJson(f"unexpected {char!r} in a tool name")

    def _marker_char(self, char: str) -> None:
        self._marker += char
        candidates = [self._args_marker]
        if self._id_marker and self._state is not _State.ID and not self._has_id:
            candidates.append(self._id_marker)
        if self._marker == self._args_marker:
            self._start_arguments()
        elif self._marker == self._id_marker and self._id_marker in candidates:
            self._has_id = True
            self._state = _State.ID
        elif not any(m.startswith(self._marker) for m in candidates):
            raise MalformedJson(f"unexpected {self._marker!r} in a tool call")

    def _start_arguments(self) -> None:
        if not self._name:
            raise MalformedJson("a tool call without a name")
        self.values["name"] = json.dumps("".join(self._name))
        if self._id:
            self.values["id"] = json.dumps("".join(self._id))
        self._state = _State.ARGUMENTS

    def _read_arguments(self, text: str) -> int:
        read = self._arguments.feed(text)
        self._raw.append(text[:read])
        if self._arguments.is_done:
            self.values["arguments"] = "".join(self._raw).strip(WHITESPACE)
            self._state = _State.DONE
        return read
