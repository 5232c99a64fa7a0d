"""One scheduler request's output as text: incremental detokenization, stop strings, EOS hiding.

A Generation submits one SubmitRequest through the EngineClient and turns its token deltas
into GenerationOutputs: new text (never a broken UTF-8 sequence, never a stop string or the
token that ended the request), the new token ids, per-token logprobs when asked, and the
finish reason. A matched stop string aborts the scheduler request at once, and so does an
OutputWatch that ends the output (a tool reply repeating a call); the watch also hears how
the output finished (a structured reply is judged then). Latency and token metrics are
recorded on the way. Owns: one request's text state. Does not own: API
shapes (serving_*.py), the request stream (EngineClient), what text a token is (tokenizer).
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from justapi.frontend.engine_client import EngineClient, RequestDelta
from justapi.frontend.metrics import RequestTimer
from justapi.frontend.text.detokenizer import (
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
)
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.wire.protocol import FINISH_ABORT, FINISH_ERROR, FINISH_STOP, SubmitRequest

logger = logging.getLogger(__name__)


class OutputWatch(Protocol):
    """Reads one generation's text as it is shown (after stop strings), and may end it early
    (the request is then aborted and finishes with "stop"), e.g. at a repeated tool call."""

    can_end: bool
    """Whether feed may end the generation (its text then goes token by token)."""

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text to show now, True to end the generation after it)."""

    def flush(self) -> str:
        """Text held back, at the end."""

    def finished(self, finish_reason: str) -> None:
        """The generation ended (every finish reason, "abort" included)."""


@dataclass(frozen=True)
class TextOptions:
    """How a request's tokens become text."""

    stop: tuple[str, ...] = ()
    """Stop strings: the text ends before the first match and the request is aborted."""
    hidden_token_ids: frozenset[int] = frozenset()
    """Tokens that show no text when they end the request (end-of-generation, stop ids)."""
    skip_special_tokens: bool = True
    with_logprobs: bool = False
    """Keep one TokenLogprob per token (and decode token by token, for text offsets)."""
    watch: Callable[[], OutputWatch] | None = None
    """Makes each generation's watch (a structured reply's check, the tool-call reader)."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int
    """Characters of this generation's text before this token's text."""


@dataclass
class GenerationOutput:
    """What one delta added. token_ids may be more than the text shows (a hidden stop token)."""

    text: str
    token_ids: list[int]
    finish_reason: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None


class Generation:
    """Submit one request and iterate its outputs; `close()` aborts it if still running."""

    def __init__(self, engine: EngineClient, request: SubmitRequest, tokenizer: Tokenizer,
                 options: TextOptions, timer: RequestTimer | None = None) -> None:
        self.request_id = request.request_id
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason = ""
        self._engine = engine
        self._options = options
        self._timer = timer
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=options.skip_special_tokens,
            prompt_token_ids=request.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:].tolist())
        self._matcher = StopStringMatcher(list(options.stop)) if options.stop else None
        self._watch = options.watch() if options.watch is not None else None
        self._num_chars = 0
        self._stream = engine.submit(request)

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._matcher.matched_stop if self._matcher is not None else None

    async def outputs(self) -> AsyncIterator[GenerationOutput]:
        """Outputs until (and including) the one with a finish_reason. Empty deltas are skipped."""
        try:
            async for delta in self._stream:
                try:
                    output = self._process(delta)
                except Exception as exc:  # this request's text failed: it alone ends
                    output = self._failed(exc)
                if output.text or output.token_ids or output.finish_reason:
                    yield output
                    self._engine.timeline.mark("sse_out", -1, len(output.token_ids))
                if self.finish_reason:
                    return
        finally:
            self.close()

    async def collect(self) -> GenerationOutput:
        """The whole generation as one output."""
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        last = GenerationOutput("", [])
        async for last in self.outputs():
            text.append(last.text)
            token_ids.extend(last.token_ids)
            logprobs.extend(last.logprobs)
        return GenerationOutput("".join(text), token_ids, self.finish_reason, logprobs, last.error)

    def close(self) -> None:
        """Abort the scheduler request unless it finished (idempotent)."""
        if not self.finish_reason:
            self._engine.abort(self.request_id)
            self._finish(FINISH_ABORT)

    # ---------------------------------------------------------------- per delta
    def _process(self, delta: RequestDelta) -> GenerationOutput:
        if delta.num_cached_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        token_ids = delta.token_ids
        self.num_output_tokens += len(token_ids)
        if self._timer is not None:
            self._timer.on_tokens(len(token_ids))
        if delta.finish_reason == FINISH_ERROR or delta.error:
            self._finish(FINISH_ERROR)
            return GenerationOutput("", token_ids, FINISH_ERROR,
                                    error=delta.error or "engine error")
        shown = token_ids
        if (delta.finish_reason == FINISH_STOP and token_ids
                and token_ids[-1] in self._options.hidden_token_ids):
            shown = token_ids[:-1]
        if self._matcher is None and not self._options.with_logprobs and not (
                self._watch is not None and self._watch.can_end):
            text = self._detokenizer.add(shown)
            output = GenerationOutput(self._watch.feed(text)[0] if self._watch else text,
                                      token_ids)
        else:
            output = self._token_by_token(delta, shown)
        if delta.finish_reason and not self.finish_reason:
            text, matched = self._flush()
            output.text += text
            output.finish_reason = FINISH_STOP if matched else delta.finish_reason
            self._finish(output.finish_reason)
        self._num_chars += len(output.text)
        return output

    def _failed(self, exc: Exception) -> GenerationOutput:
        """Its text could not be made (a detokenizer or stop-string bug met by its tokens):
        the scheduler request is aborted, the request ends with an error, counted by stage."""
        logger.error("request %r failed while detokenizing it: %s: %s", self.request_id,
                     type(exc).__name__, exc, exc_info=exc)
        self._engine.abort(self.request_id)
        self._finish(FINISH_ERROR)
        if self._timer is not None:
            self._timer.on_failure("detokenize")
        return GenerationOutput("", [], FINISH_ERROR,
                                error=f"detokenize failed: {type(exc).__name__}: {exc}")

    def _token_by_token(self, delta: RequestDelta, shown: list[int]) -> GenerationOutput:
        """Decode one token at a time so stop strings cut at the right token and each
        token's text offset is known."""
        texts: list[str] = []
        num_chars = self._num_chars
        logprobs: list[TokenLogprob] = []
        for index, token_id in enumerate(delta.token_ids):
            if self._options.with_logprobs:
                top = delta.top_logprobs[index] if index < len(delta.top_logprobs) else []
                logprob = delta.logprobs[index] if index < len(delta.logprobs) else float("nan")
                logprobs.append(TokenLogprob(token_id, logprob, top, num_chars))
            if index >= len(shown):
                break  # the hidden stop token: counted, never shown
            text, matched = self._shown(self._detokenizer.add([token_id]))
            if matched:
                texts.append(text)
                return self._stopped_by_string(delta.token_ids, index + 1, texts, logprobs)
            texts.append(text)
            num_chars += len(text)
        return GenerationOutput("".join(texts), delta.token_ids, logprobs=logprobs)

    def _stopped_by_string(self, token_ids: list[int], num_kept: int, texts: list[str],
                           logprobs: list[TokenLogprob]) -> GenerationOutput:
        """A stop string matched in the text of token_ids[num_kept - 1]: later tokens of the
        delta are dropped and the scheduler request is aborted."""
        self.num_output_tokens -= len(token_ids) - num_kept
        self._engine.abort(self.request_id)
        self._finish(FINISH_STOP)
        return GenerationOutput("".join(texts), token_ids[:num_kept], FINISH_STOP, logprobs)

    def _shown(self, text: str) -> tuple[str, bool]:
        """New text through the stop strings, then the watch; True: the output ends here."""
        matched = False
        if self._matcher is not None:
            text, matched = self._matcher.feed(text)
        if self._watch is not None:
            text, ended = self._watch.feed(text)
            matched = matched or ended
        return text, matched

    def _flush(self) -> tuple[str, bool]:
        """The text held back at the end (incomplete bytes, a possible stop-string start, what
        the watch held); and whether a stop string matched (or the watch ended) in it."""
        text, matched = self._shown(self._detokenizer.flush())
        if matched:
            return text, True
        if self._matcher is not None:
            held = self._matcher.flush()
            if self._watch is not None:
                held, matched = self._watch.feed(held)
            text += held
        if self._watch is not None and not matched:
            text += self._watch.flush()
        return text, matched

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if self._watch is not None:
            self._watch.finished(reason)
        if self._timer is not None:
            self._timer.on_finish(reason)
