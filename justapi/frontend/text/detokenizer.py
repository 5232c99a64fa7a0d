"""Streaming text for one request: token ids in, only the new text out; and stop strings.

Owns: the per-request decode window (vLLM's prefix/read offsets) that holds back incomplete
UTF-8 until it resolves, and the stop-string matcher that holds back text which could still
become a stop string. Does not own: the vocabulary (tokenizer.py) or when a request ends.
"""
from __future__ import annotations

from collections.abc import Sequence

from justapi.frontend.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens kept as decode context, so the first output token gets its leading space."""
MAX_WINDOW_TOKENS = 64
"""Ids before the window are dropped once this many pile up (memory stays O(window))."""
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation equals
    `tokenizer.decode(all ids)` (read after `prompt_token_ids`), never splitting a character.

    Token window (indices into self._token_ids):
        [ ...dropped... | prefix_offset ........ read_offset ........ len ]
                          ^ decode context        ^ text up to here was emitted
    Each step decodes only [prefix_offset:] and [prefix_offset:read_offset], so the cost is
    O(tokens since the last emitted text), not O(all tokens)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append token ids; return the text that is now final ('' while a character is
        incomplete or the tokens render as nothing)."""
        if not token_ids:
            return ""
        self._token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: whatever is still held back (a truly broken sequence shows as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self._token_ids[self._prefix_offset:]
        num_prefix = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:num_prefix])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # the last character's bytes are not all here yet
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._drop_old_ids()
        return full_text[len(prefix_text):]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _drop_old_ids(self) -> None:
        if self._prefix_offset >= MAX_WINDOW_TOKENS:
            del self._token_ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


class StopStringMatcher:
    """Cuts streamed text at the first stop string to complete, across any chunk boundaries.

    `feed(text)` returns (text safe to show now, matched). The stop string itself is never
    returned; text that could be the start of a stop string is held until it cannot be, and
    `flush()` releases it when the stream ends without a match."""

    def __init__(self, stop: Sequence[str]) -> None:
        _check_stop_strings(stop)
        self._stops = tuple(stop)
        self._prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._max_held = max(len(s) for s in self._stops) - 1
        self._held = ""
        self.matched_stop: str | None = None
        """The stop string that matched, once one has."""

    def feed(self, text: str) -> tuple[str, bool]:
        if self.matched_stop is not None:
            return "", True
        buffer = self._held + text
        match = self._earliest_match(buffer)
        if match is not None:
            start, self.matched_stop = match
            self._held = ""
            return buffer[:start], True
        num_held = self._num_held(buffer)
        self._held = buffer[len(buffer) - num_held:]
        return buffer[:len(buffer) - num_held], False

    def flush(self) -> str:
        """Text held back as a possible stop-string start; '' after a match."""
        held, self._held = self._held, ""
        return "" if self.matched_stop is not None else held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        """The stop occurrence that ends first (ties: the one starting first), i.e. the one a
        token-by-token stream would have completed first: the result is chunking-independent."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_held(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        for start in range(max(0, len(buffer) - self._max_held), len(buffer)):
            if buffer[start] in self._first_chars and buffer[start:] in self._prefixes:
                return len(buffer) - start
        return 0


def _check_stop_strings(stop: Sequence[str]) -> None:
    if isinstance(stop, str) or not isinstance(stop, Sequence):
        raise ValueError(f"stop must be a list of strings, got {type(stop).__name__}")
    if not 1 <= len(stop) <= MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold 1 to {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for index, value in enumerate(stop):
        if not isinstance(value, str) or not value:
            raise ValueError(f"stop[{index}] must be a non-empty string, got {value!r}")
        if len(value) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop[{index}] is {len(value)} characters long "
                             f"(at most {MAX_STOP_STRING_CHARS})")
