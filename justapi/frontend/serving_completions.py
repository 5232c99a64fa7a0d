"""/v1/completions: text or token-id prompts (or batches of them) -> choices, whole or as SSE.

Choices are numbered prompt-major (prompt p, sample j -> index p * n + j). `echo` prefixes
the prompt text (cheap: it is known); prompt logprobs are not computed, so echo with
logprobs is refused. Output constraints (response_format, vLLM's / llama-server's / SGLang's
fields) apply as on chat (constraints.py). Owns: the completion response/chunk shapes and
their logprobs.
Does not own: limits and sampling checks, the stream loop (sse.py), text state.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from justapi.frontend.choices import (
    MAX_CHOICES,
    collect_choices,
    start_choices,
    usage,
)
from justapi.frontend.constraints import approximated_header, output_rules, request_constraint
from justapi.frontend.errors import ApiError
from justapi.frontend.generation import GenerationOutput, TokenLogprob
from justapi.frontend.openai_models import CompletionRequest
from justapi.frontend.prompts import Prompt
from justapi.frontend.serving import Serving
from justapi.frontend.sse import stream_choices


def completion_prompts(serving: Serving, prompt: str | list, n: int) -> list[Prompt]:
    prompts = serving.prompts
    if isinstance(prompt, str):
        return [Prompt(prompts.encode_text(prompt), prompt)]
    if not prompt:
        raise ApiError("the prompt is empty", param="prompt")
    if not isinstance(prompt[0], int) and len(prompt) * n > MAX_CHOICES:  # before encoding
        raise ApiError(f"prompts x n must be at most {MAX_CHOICES}, got {len(prompt)} x {n}",
                       param="prompt")
    if isinstance(prompt[0], int):
        return [Prompt(prompts.check_token_ids(prompt, "prompt"))]
    if isinstance(prompt[0], str):
        return [Prompt(prompts.encode_text(text), text) for text in prompt]
    return [Prompt(prompts.check_token_ids(ids, "prompt")) for ids in prompt]


def check_supported(request: CompletionRequest) -> None:
    if request.suffix:
        raise ApiError("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise ApiError("best_of other than n is not supported", param="best_of")
    if request.echo and request.logprobs is not None:
        raise ApiError("echo with logprobs is not supported (prompt logprobs are not "
                       "computed)", param="echo")
    if request.stream_options is not None and not request.stream:
        raise ApiError("stream_options needs stream: true", param="stream_options")


async def create_completion(serving: Serving, request: CompletionRequest, arrival_s: float,
                            headers: dict[str, str] | None = None) -> dict | AsyncIterator[bytes]:
    """A full response dict, or (stream=True) an async iterator of SSE event bytes; the
    response's own headers are added to `headers`."""
    serving.check_model(request.model)
    check_supported(request)
    constraint = request_constraint(request)
    prompts = completion_prompts(serving, request.prompt, request.n)
    limits = [serving.prompts.max_tokens_for(request.max_tokens, len(p.token_ids))
              for p in prompts]
    output = output_rules(serving.metrics.structured, constraint)
    if headers is not None:
        headers.update(approximated_header(output.approximated))
    generations = start_choices(serving, request, prompts, limits, request.logprobs, arrival_s,
                                output=output)
    header = {"id": serving.new_id("cmpl"), "object": "text_completion",
              "created": int(time.time()), "model": serving.config.model_name}
    echoes = [_echo_text(serving, p) if request.echo else "" for p in prompts for _ in
              range(request.n)]
    prompt_lengths = [len(p.token_ids) for p in prompts]
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return stream_choices(generations, CompletionChunks(serving, echoes), header,
                              lambda: usage(prompt_lengths, generations), include_usage)
    outputs = await collect_choices(serving, generations, output)
    with_logprobs = request.logprobs is not None
    choices = [_choice(serving, index, echoes[index] + output.text, output, len(echoes[index]),
                       with_logprobs) for index, output in enumerate(outputs)]
    return {**header, "choices": choices, "usage": usage(prompt_lengths, generations)}


class CompletionChunks:
    """Completions' `choices` entries: the echoed prompt to open, then text deltas whose
    logprobs' text offsets count the echo."""

    def __init__(self, serving: Serving, echoes: list[str]) -> None:
        self._serving = serving
        self._echoes = echoes

    def opening(self, index: int) -> dict | None:
        echo = self._echoes[index]
        if not echo:
            return None
        return {"index": index, "text": echo, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, output: GenerationOutput) -> dict | None:
        if not (output.text or output.finish_reason or output.logprobs):
            return None  # tokens whose text is still held back (a partial character)
        logprobs = None
        if output.logprobs:
            logprobs = completion_logprobs(self._serving, output.logprobs,
                                           len(self._echoes[index]))
        return {"index": index, "text": output.text, "logprobs": logprobs,
                "finish_reason": output.finish_reason or None}


def _echo_text(serving: Serving, prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return serving.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def _choice(serving: Serving, index: int, text: str, output: GenerationOutput,
            offset_base: int, with_logprobs: bool) -> dict:
    logprobs = completion_logprobs(serving, output.logprobs, offset_base) if with_logprobs else None
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": output.finish_reason or None}


def completion_logprobs(serving: Serving, entries: list[TokenLogprob], offset_base: int) -> dict:
    """Legacy completions logprobs: parallel lists, top_logprobs keyed by token text (the
    sampled token is always among them, as OpenAI documents)."""
    text = serving.token_text
    top_logprobs = []
    for entry in entries:
        top: dict[str, float] = {}
        for token_id, logprob in [(entry.token_id, entry.logprob), *entry.top]:
            top.setdefault(text(token_id), logprob)  # tokens that render alike: keep the likeliest
        top_logprobs.append(top)
    return {"tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top_logprobs,
            "text_offset": [offset_base + e.text_offset for e in entries]}
