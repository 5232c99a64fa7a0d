"""One choice's reply read the way every endpoint reads it: thinking split off first
(reasoning/), then tool calls parsed out of the answer (tools/), as it streams or whole.

`ReplyRules` say how a request's replies are read; `ReplyReader` reads one choice's outputs
into ReplyDeltas (reasoning text, content text, tool-call deltas); `whole_reply` reads a whole
output into a Reply; `AnswerWatch` puts an output watch (a tool reply's, a structured reply's
check) over the answer alone of a reply that may think. Chat, /v1/responses and /v1/messages all shape these same pieces, so a
reply means the same on every endpoint. Owns: that composition. Does not own: the split
(reasoning/splitter.py), the call parser (tools/parser.py) or any response shape.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from justapi.frontend.generation import GenerationOutput, OutputWatch
from justapi.frontend.reasoning.request import NO_REASONING, ReasoningSetup
from justapi.frontend.reasoning.splitter import ReasoningDelta, ReasoningSplitter
from justapi.frontend.tools.parser import (
    FINISH_TOOL_CALLS,
    ToolCall,
    ToolCallDelta,
    ToolReply,
    parse_reply,
)
from justapi.frontend.tools.request import ToolPlan
from justapi.wire.protocol import FINISH_STOP


@dataclass(frozen=True)
class ReplyRules:
    """How one request's replies are read."""

    plan: ToolPlan | None = None
    """The tool calls a reply may make (None: the answer is all content)."""
    reasoning: ReasoningSetup = NO_REASONING
    prompt_text: str | None = None
    """The rendered prompt (whether a reply starts inside its thinking)."""

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning.format is not None

    def reader(self) -> ReplyReader:
        return ReplyReader(self)


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ReplyReader:
    """One choice's outputs, in order -> ReplyDeltas; its finish reason and thinking tokens."""

    def __init__(self, rules: ReplyRules) -> None:
        self._splitter = rules.reasoning.splitter(rules.prompt_text)
        self._tools = ToolReply(rules.plan.tool_format) if rules.plan else None

    @property
    def reasoning_tokens(self) -> int:
        return self._splitter.reasoning_tokens if self._splitter else 0

    def add(self, output: GenerationOutput) -> ReplyDelta:
        """The reply's next output (the last one carries its finish_reason)."""
        split = ReasoningDelta(content=output.text)
        if self._splitter is not None:
            split = self._splitter.feed(output.text, output.token_ids)
            if output.finish_reason:
                tail = self._splitter.finish()
                split = ReasoningDelta(split.reasoning + tail.reasoning,
                                       split.content + tail.content)
        if self._tools is None:
            return ReplyDelta(split.reasoning, split.content)
        parsed = self._tools.add(split.content, output.finish_reason)
        return ReplyDelta(split.reasoning, parsed.content, parsed.tool_calls)

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" for a reply that called and ended by itself, else `reason`."""
        return self._tools.finish_reason(reason) if self._tools else reason


@dataclass
class Reply:
    """A whole reply: thinking, answer and calls."""

    reasoning: str | None
    """None: the reply did not think (or no reasoning format)."""
    content: str | None
    """None: a reply that is calls only."""
    tool_calls: list[ToolCall]
    finish_reason: str
    reasoning_tokens: int


def whole_reply(rules: ReplyRules, output: GenerationOutput) -> Reply:
    """A whole output read as its stream would be (calls parsed as chat's full response does)."""
    splitter = rules.reasoning.splitter(rules.prompt_text)
    reasoning: str | None = None
    text = output.text
    if splitter is not None:
        split = splitter.feed(output.text, output.token_ids)
        tail = splitter.finish()
        text = split.content + tail.content
        if splitter.has_reasoning:
            reasoning = split.reasoning + tail.reasoning
    content: str | None = text
    calls: list[ToolCall] = []
    finish_reason = output.finish_reason
    if rules.plan is not None:
        content, calls = parse_reply(rules.plan.tool_format, text, finish_reason)
        if calls and finish_reason == FINISH_STOP:
            finish_reason = FINISH_TOOL_CALLS
    tokens = splitter.reasoning_tokens if splitter else 0
    return Reply(reasoning, content, calls, finish_reason, tokens)


class AnswerWatch:
    """An output watch (generation.OutputWatch) for a reply that may think: the thinking and
    its markers are shown as they come; the answer after the end marker goes through `inner`,
    which may hold it back or end the reply (a repeated tool call) and judges it at the end.
    Text the splitter holds (a possible marker) is held here too, so nothing is shown twice or
    out of order."""

    def __init__(self, inner: OutputWatch, splitter: ReasoningSplitter) -> None:
        self._inner = inner
        self._splitter = splitter
        self.can_end = inner.can_end
        self._pending = ""  # text fed that the splitter still holds

    @classmethod
    def factory(cls, inner: Callable[[], OutputWatch], rules: ReplyRules
                ) -> Callable[[], OutputWatch]:
        """Each generation's watch: `inner`'s over the answer (`inner` alone for a request
        whose replies do not think)."""
        def make() -> OutputWatch:
            splitter = rules.reasoning.splitter(rules.prompt_text)
            return inner() if splitter is None else cls(inner(), splitter)
        return make

    def feed(self, text: str) -> tuple[str, bool]:
        self._pending += text
        split = self._splitter.feed(text)
        released = len(self._pending) - self._splitter.num_held
        shown, self._pending = self._pending[:released], self._pending[released:]
        return self._answer(shown, split.content)

    def flush(self) -> str:
        tail = self._splitter.finish()
        shown, self._pending = self._pending, ""
        text, _ = self._answer(shown, tail.content)
        return text + self._inner.flush()

    def finished(self, finish_reason: str) -> None:
        self._inner.finished(finish_reason)

    def _answer(self, shown: str, content: str) -> tuple[str, bool]:
        """`shown` with its answer part (`content`, always its end) read by the inner watch."""
        if not content:
            return shown, False
        text, ended = self._inner.feed(content)
        return shown[:len(shown) - len(content)] + text, ended
