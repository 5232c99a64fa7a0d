"""A request's thinking: the template variables that switch it (chat_template_kwargs,
reasoning_effort), and where its output constraint starts.

`reasoning_effort` goes to the template as itself (gpt-oss templates read it) and, for a
template with Qwen3's `enable_thinking` switch, as that switch: "none" turns thinking off, any
other effort on. `chat_template_kwargs` are passed as they come and win over both. A constraint
(response format, tool calls) of a reply that may think applies after its thinking block.
Owns: those mappings and the served template's reasoning traits. Does not own: the markers
(formats.py) or rendering (text/chat_template.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from justapi.frontend.errors import ApiError
from justapi.frontend.reasoning.formats import AUTO, ReasoningFormat, reasoning_format
from justapi.frontend.reasoning.splitter import ReasoningSplitter
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.sampling import StructuredOutput

RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
"""Template variables a request's chat_template_kwargs may not replace."""
MAX_TEMPLATE_KWARGS = 64
THINKING_SWITCH = "enable_thinking"
NO_EFFORT = "none"


@dataclass(frozen=True)
class ReasoningSetup:
    """What the served chat template (and --reasoning-parser) say about thinking."""

    format: ReasoningFormat | None = None
    """The markers replies are split at; None: replies are all content."""
    has_thinking_switch: bool = False
    """The template reads `enable_thinking` (reasoning_effort "none" sets it false)."""
    start_token_id: int | None = None
    """The start marker as one token of the vocabulary (None: it is text)."""
    end_token_id: int | None = None
    """The end marker as one token (counts thinking tokens exactly; None: it is text)."""
    count_text: Callable[[str], int] = field(default=len, compare=False)
    """Tokens of a text (thinking tokens where the end marker is not one token)."""

    @classmethod
    def from_template(cls, template_source: str, tokenizer: Tokenizer,
                      parser: str = AUTO) -> ReasoningSetup:
        found = reasoning_format(parser, template_source)
        if found is None:
            return cls(None, THINKING_SWITCH in template_source)
        return cls(found, THINKING_SWITCH in template_source, tokenizer.token_to_id(found.start),
                   tokenizer.token_to_id(found.end),
                   lambda text: len(tokenizer.encode(text, add_special_tokens=False)))

    def template_variables(self, kwargs: dict[str, Any] | None,
                           effort: str | None) -> dict[str, Any]:
        """The extra variables a request renders its template with."""
        variables: dict[str, Any] = {}
        if effort is not None:
            variables["reasoning_effort"] = effort
            if self.has_thinking_switch:
                variables[THINKING_SWITCH] = effort != NO_EFFORT
        variables.update(_checked_kwargs(kwargs or {}))
        return variables

    def splitter(self, prompt_text: str | None) -> ReasoningSplitter | None:
        """A reply's splitter (None: no reasoning format)."""
        if self.format is None:
            return None
        return ReasoningSplitter(self.format, starts_thinking=self.starts_thinking(prompt_text),
                                 end_token_id=self.end_token_id, count_text=self.count_text)

    def starts_thinking(self, prompt_text: str | None) -> bool:
        return self.format is not None and self.format.opens_in(prompt_text or "")

    def after_thinking(self, structured: StructuredOutput | None,
                       prompt_text: str | None) -> StructuredOutput | None:
        """The constraint applied from the end of the thinking block (unchanged without a
        reasoning format)."""
        if structured is None or self.format is None:
            return structured
        start = "" if self.starts_thinking(prompt_text) \
            else _marker(self.format.start, self.start_token_id)
        return dataclasses.replace(structured, reasoning_start=start,
                                   reasoning_end=_marker(self.format.end, self.end_token_id))


NO_REASONING = ReasoningSetup()


def _marker(text: str, token_id: int | None) -> str:
    """A marker as a constraint names it: its token (a model writes a marker that is one token
    as that token, which grammars see as a special token, not as text), else its text."""
    return text if token_id is None else f"<[{token_id}]>"


def _checked_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ApiError(f"chat_template_kwargs takes at most {MAX_TEMPLATE_KWARGS} keys, got "
                       f"{len(kwargs)}", param="chat_template_kwargs")
    for name in kwargs:
        if name in RESERVED_VARIABLES or not name.isidentifier():
            raise ApiError(f"chat_template_kwargs may not set {name!r} (the request's own "
                           "fields set messages, tools and add_generation_prompt)",
                           param="chat_template_kwargs")
    return dict(kwargs)
