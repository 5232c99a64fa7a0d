"""One JSON object read a character at a time, for tool calls that stream while generated.

The scanner records each top-level key and the raw text of its value (the model's own bytes,
so streamed argument fragments concatenate to exactly the final string), and exposes the value
being read so far. It checks structure only (strings, nesting, separators), not number
syntax: a call is judged by json.loads once complete. Owns: that scan. Does not own: what the
keys mean (parser.py).
"""
from __future__ import annotations

import json
from enum import Enum

WHITESPACE = " \t\n\r"
_SCALAR_ENDS = ",}]" + WHITESPACE


class MalformedJson(ValueError):
    """The text is not a JSON object."""


class _State(Enum):
    BEFORE = 0
    KEY_OR_END = 1
    KEY = 2
    COLON = 3
    VALUE_START = 4
    VALUE = 5
    AFTER_VALUE = 6
    DONE = 7


class ObjectScanner:
    """Feed text until `is_done`; `values` holds complete raw values by key."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.key: str | None = None
        """The key whose value is being read (None between values)."""
        self._state = _State.BEFORE
        self._chars: list[str] = []  # the key or value being read, raw
        self._depth = 0
        self._in_string = False
        self._escape = False

    @property
    def has_started(self) -> bool:
        """Its opening brace was read."""
        return self._state is not _State.BEFORE

    @property
    def is_done(self) -> bool:
        return self._state is _State.DONE

    def partial_value(self) -> str:
        """The raw text of the value being read so far ("" between values)."""
        return "".join(self._chars) if self._state is _State.VALUE else ""

    def feed(self, text: str) -> int:
        """Read text until the object closes; return how many characters were read."""
        for index, char in enumerate(text):
            if self._state is _State.DONE:
                return index
            self._step(char)
        return len(text)

    def _step(self, char: str) -> None:
        state = self._state
        if state is _State.VALUE:
            if self._value_char(char):
                return
            state = self._state  # a scalar ended: this character comes after it
        if state is _State.KEY:
            self._key_char(char)
        elif char in WHITESPACE:
            return
        elif state is _State.BEFORE:
            self._expect(char, "{", _State.KEY_OR_END)
        elif state is _State.KEY_OR_END:
            self._state = _State.DONE if char == "}" else self._start_key(char)
        elif state is _State.COLON:
            self._expect(char, ":", _State.VALUE_START)
        elif state is _State.VALUE_START:
            self._start_value(char)
        elif state is _State.AFTER_VALUE:
            self._state = {",": _State.KEY_OR_END, "}": _State.DONE}.get(char) \
                or self._fail(char)

    def _expect(self, char: str, wanted: str, then: _State) -> None:
        if char != wanted:
            self._fail(char)
        self._state = then

    def _fail(self, char: str) -> _State:
        raise MalformedJson(f"unexpected {char!r} in a JSON object")

    def _start_key(self, char: str) -> _State:
        if char != '"':
            self._fail(char)
        self._chars = [char]
        return _State.KEY

    def _key_char(self, char: str) -> None:
        self._chars.append(char)
        if self._string_ends(char):
            self.key = _decode_key("".join(self._chars))
            self._state = _State.COLON

    def _start_value(self, char: str) -> None:
        self._chars = [char]
        self._state = _State.VALUE
        self._depth = 1 if char in "{[" else 0
        self._in_string = char == '"'
        self._escape = False

    def _value_char(self, char: str) -> bool:
        """Take one character of the value; False when a scalar ended before it."""
        if self._depth == 0 and not self._in_string and self._chars[0] != '"':
            if char in _SCALAR_ENDS:  # a number or literal ends at what follows it
                self._end_value()
                return False
            self._chars.append(char)
            return True
        self._chars.append(char)
        if self._in_string:
            if self._string_ends(char):
                self._in_string = False
                if self._depth == 0:
                    self._end_value()
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value()
        return True

    def _string_ends(self, char: str) -> bool:
        """Inside a string (its opening quote already read): whether `char` closes it."""
        if self._escape:
            self._escape = False
            return False
        if char == "\\":
            self._escape = True
            return False
        return char == '"' and len(self._chars) > 1

    def _end_value(self) -> None:
        assert self.key is not None
        self.values[self.key] = "".join(self._chars)
        self.key = None
        self._chars = []
        self._state = _State.AFTER_VALUE


def _decode_key(raw: str) -> str:
    try:
        return str(json.loads(raw))
    except ValueError:
        raise MalformedJson(f"bad key {raw!r}") from None
