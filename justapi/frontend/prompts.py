"""Prompts as the scheduler takes them: text, token-id and chat prompts -> checked token ids.

Tokenizes text (the scheduler sees only ids), renders chat messages with the model's
template, checks token ids against the vocabulary and applies the context rule (prompt +
max_tokens <= max_context). Owns: those checks. Does not own: sampling or response shapes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from justapi.frontend.errors import ApiError
from justapi.frontend.text.tokenizer import Tokenizer


class ChatRenderer(Protocol):
    """The chat template: messages (and tools, and a request's extra template variables such
    as enable_thinking) -> prompt text; ValueError for bad messages."""

    def __call__(self, messages: list[dict], add_generation_prompt: bool,
                 tools: list[dict] | None = None, **variables: Any) -> str: ...


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None
    """The prompt as text when the client sent text (for echo)."""


class Prompts:
    """The model's prompt rules: its tokenizer, chat template and context length."""

    def __init__(self, tokenizer: Tokenizer, render_chat: ChatRenderer, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.render_chat = render_chat
        self.max_context = max_context

    def encode_text(self, text: str, add_special_tokens: bool = True,
                    param: str = "prompt") -> list[int]:
        _check_unicode(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool,
                    tools: list[dict] | None = None,
                    variables: dict[str, Any] | None = None) -> Prompt:
        try:
            text = self.render_chat(messages, add_generation_prompt, tools, **(variables or {}))
        except ValueError as exc:
            raise ApiError(str(exc), param="messages") from None
        return Prompt(self.encode_text(text, False, "messages"), text)

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> list[int]:
        return check_token_ids(token_ids, self.tokenizer.vocab_size, param)

    def max_tokens_for(self, requested: int | None, num_prompt_tokens: int, *,
                       param: str = "max_tokens", prompt_param: str = "prompt") -> int:
        """The context rule: prompt + max_tokens <= max_context, and at least one new token.
        None asks for all the room the context leaves."""
        limit = self.max_context
        if num_prompt_tokens == 0:
            raise ApiError("the prompt is empty", param=prompt_param)
        if num_prompt_tokens >= limit:
            raise ApiError(f"the prompt has {num_prompt_tokens} tokens; this model's context "
                           f"length is {limit} tokens (prompt plus at least one new token)",
                           param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return limit - num_prompt_tokens
        if requested < 1:
            raise ApiError(f"{param} must be an integer >= 1, got {requested}", param=param)
        if num_prompt_tokens + requested > limit:
            raise ApiError(f"this model's context length is {limit} tokens; the request needs "
                           f"{num_prompt_tokens + requested} ({num_prompt_tokens} in the prompt, "
                           f"{requested} for the completion): lower {param} or the prompt",
                           param=param, code="context_length_exceeded")
        return requested


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """The ids as a list, or ApiError naming the first one outside [0, vocab_size)."""
    ids = list(token_ids)
    if ids:
        try:
            array = np.asarray(ids, dtype=np.int64)
            is_valid = int(array.min()) >= 0 and int(array.max()) < vocab_size
        except OverflowError:  # JSON integers have no size limit
            is_valid = False
        if not is_valid:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ApiError(f"token id {bad} is not in the vocabulary [0, {vocab_size})",
                           param=param)
    return ids


def _check_unicode(text: str, param: str) -> None:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"); they are not text and no tokenizer
    takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"{param} is not valid Unicode: {exc.reason} at character {exc.start}",
                       param=param) from None
