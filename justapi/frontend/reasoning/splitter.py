"""One reply split into its thinking and its answer, as it streams.

Feed each output's text and token ids; each `feed` returns the reasoning and the content it
adds. A reply that starts inside its thinking (the prompt opened it) is reasoning up to the
first end marker; otherwise a reply that opens with the start marker (after whitespace) thinks,
and any other reply is all content. Text that may still become a marker is held back until it
is known; the markers themselves are neither reasoning nor content, and nothing is stripped,
so reasoning + markers + content is exactly the generated text. A reply cut off while thinking
is all reasoning. The whole reply is split by the same code. Thinking tokens are counted up to
and including the end marker's token; where the marker is not one token, the thinking's text
(markers included) is tokenized again, so a whole and a streamed reply count alike. Owns: that
split and that count. Does not own: the markers (formats.py) or tool calls in the content.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from justapi.frontend.reasoning.formats import ReasoningFormat

WHITESPACE = " \t\r\n"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class _Phase(Enum):
    MAYBE = 0  # before the reply shows whether it thinks
    THINKING = 1
    ANSWER = 2


class ReasoningSplitter:
    """One choice's split. end_token_id: the end marker's own token (counts thinking tokens
    exactly even when its text arrives in a later output); without it, count_text counts the
    tokens of the thinking's text."""

    def __init__(self, reasoning_format: ReasoningFormat, *, starts_thinking: bool,
                 end_token_id: int | None = None,
                 count_text: Callable[[str], int] = len) -> None:
        self.format = reasoning_format
        self.has_reasoning = starts_thinking
        """The reply thinks (known once it opened its thinking, or from the start)."""
        self._phase = _Phase.THINKING if starts_thinking else _Phase.MAYBE
        self._held = ""
        self._end_token_id = end_token_id
        self._count_text = count_text
        self._num_tokens = 0
        self._end_at: int | None = None  # tokens up to and including the end marker
        self._thinking: list[str] = []  # the thinking's text, markers included

    @property
    def reasoning_tokens(self) -> int:
        """Tokens spent thinking: up to and including the end marker (all of them when the
        reply was cut off while thinking); 0 for a reply that did not think."""
        if not self.has_reasoning:
            return 0
        if self._end_token_id is None:
            return self._count_text("".join(self._thinking))
        return self._end_at if self._end_at is not None else self._num_tokens

    @property
    def num_held(self) -> int:
        """Characters fed and not given back yet (the end of the text, which may still become
        a marker)."""
        return len(self._held)

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ReasoningDelta:
        self._count(token_ids)
        if self._phase is _Phase.ANSWER:
            return ReasoningDelta(content=text)
        self._held += text
        out = ReasoningDelta()
        if self._phase is _Phase.MAYBE:
            self._read_opening(out)
        if self._phase is _Phase.THINKING:
            self._read_thinking(out)
        return out

    def finish(self) -> ReasoningDelta:
        """What was held back, at the end of the reply."""
        held, self._held = self._held, ""
        if self._phase is _Phase.THINKING:
            self._thinking.append(held)
            return ReasoningDelta(reasoning=held)
        self._phase = _Phase.ANSWER
        return ReasoningDelta(content=held)

    # ---------------------------------------------------------------- phases
    def _count(self, token_ids: Sequence[int]) -> None:
        if self._end_at is None and self._end_token_id is not None \
                and self._end_token_id in token_ids:
            self._end_at = self._num_tokens + list(token_ids).index(self._end_token_id) + 1
        self._num_tokens += len(token_ids)

    def _read_opening(self, out: ReasoningDelta) -> None:
        start = self.format.start
        body = self._held.lstrip(WHITESPACE)
        if body.startswith(start):
            self._thinking.append(start)
            self._held = body[len(start):]
            self._phase = _Phase.THINKING
            self.has_reasoning = True
        elif not start.startswith(body):  # it cannot become the start marker any more
            out.content += self._held
            self._held = ""
            self._phase = _Phase.ANSWER

    def _read_thinking(self, out: ReasoningDelta) -> None:
        end = self.format.end
        at = self._held.find(end)
        if at >= 0:
            self._thinking += [self._held[:at], end]
            out.reasoning += self._held[:at]
            out.content += self._held[at + len(end):]
            self._held = ""
            self._phase = _Phase.ANSWER
            if self._end_at is None:  # the marker written as text, not as its token
                self._end_at = self._num_tokens
            return
        keep = _partial_suffix(self._held, end)
        shown = self._held[:len(self._held) - keep]
        self._thinking.append(shown)
        out.reasoning += shown
        self._held = self._held[len(self._held) - keep:]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest ending of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
