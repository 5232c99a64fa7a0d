"""/v1/chat/completions: messages rendered with the model's chat template -> assistant choices.

The template comes from the GGUF (serving.render_chat); the rendered text is tokenized
without adding BOS again (the template writes it). Streams open each choice with a
`{"role": "assistant", "content": ""}` delta, like OpenAI. Owns: the chat response/chunk
shapes and chat logprobs. Does not own: limits and sampling (serving.py), text state.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from justapi.frontend.errors import SERVER_ERROR, ApiError, error_body
from justapi.frontend.generation import Generation, TokenLogprob
from justapi.frontend.openai_models import ChatCompletionRequest, ChatMessage
from justapi.frontend.serving import (
    SSE_DONE,
    Serving,
    close_all,
    collect_all,
    fan_in,
    sse_event,
    usage,
)
from justapi.sampling import MAX_TOP_LOGPROBS
from justapi.wire.protocol import FINISH_ERROR


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Validated messages -> the plain dicts the chat template takes (it joins text parts)."""
    return [message.model_dump(exclude_none=True) for message in messages]


def check_supported(request: ChatCompletionRequest) -> int | None:
    """Refuse what is not served; return the logprobs width to sample with (None: none)."""
    if request.tools:
        raise ApiError("tools are not supported", param="tools")
    if request.response_format and request.response_format.get("type") != "text":
        raise ApiError("only response_format {'type': 'text'} is supported",
                       param="response_format")
    if request.stream_options is not None and not request.stream:
        raise ApiError("stream_options needs stream: true", param="stream_options")
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                       f"{request.top_logprobs}", param="top_logprobs")
    if not request.logprobs:
        return None
    return request.top_logprobs or 0


async def create_chat_completion(serving: Serving, request: ChatCompletionRequest,
                                 arrival_s: float) -> dict | AsyncIterator[bytes]:
    """A full response dict, or (stream=True) an async iterator of SSE event bytes."""
    serving.check_model(request.model)
    logprobs = check_supported(request)
    prompt = serving.chat_prompt(message_dicts(request.messages), request.add_generation_prompt)
    param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
    requested = request.max_completion_tokens if request.max_completion_tokens is not None \
        else request.max_tokens
    limit = serving.max_tokens_for(requested, len(prompt.token_ids), param=param,
                                   prompt_param="messages")
    generations = serving.start_choices(request, [prompt], [limit], logprobs, arrival_s)
    header = {"id": serving.new_id("chatcmpl"), "object": "chat.completion",
              "created": int(time.time()), "model": serving.config.model_name}
    num_prompt = [len(prompt.token_ids)]
    top_n = logprobs or 0
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return _stream(serving, generations, num_prompt, header, logprobs is not None,
                       top_n, include_usage)
    outputs = await collect_all(generations)
    choices = []
    for index, output in enumerate(outputs):
        if output.finish_reason == FINISH_ERROR:
            raise serving.generation_failed(output.error)
        choices.append({
            "index": index, "message": {"role": "assistant", "content": output.text},
            "logprobs": chat_logprobs(serving, output.logprobs, top_n) if logprobs is not None
            else None,
            "finish_reason": output.finish_reason or None})
    return {**header, "choices": choices, "usage": usage(num_prompt, generations)}


def chat_logprobs(serving: Serving, entries: list[TokenLogprob], top_n: int) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = serving.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for entry in entries:
        token = item(entry.token_id, entry.logprob)
        token["top_logprobs"] = [item(t, lp) for t, lp in entry.top[:top_n]]
        content.append(token)
    return {"content": content}


async def _stream(serving: Serving, generations: list[Generation], num_prompt: list[int],
                  header: dict, with_logprobs: bool, top_n: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    header = {**header, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    try:
        for index in range(len(generations)):
            yield sse_event({**header, "choices": [
                {"index": index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}], **extra})
        async for index, output in fan_in(generations):
            if output.finish_reason == FINISH_ERROR:
                yield sse_event(error_body(f"generation failed: {output.error}", SERVER_ERROR))
                break
            if not (output.text or output.finish_reason or output.logprobs):
                continue  # tokens whose text is still held back (a partial character)
            logprobs = chat_logprobs(serving, output.logprobs, top_n) if with_logprobs else None
            delta = {"content": output.text} if output.text else {}
            yield sse_event({**header, "choices": [
                {"index": index, "delta": delta, "logprobs": logprobs,
                 "finish_reason": output.finish_reason or None}], **extra})
        if include_usage:
            yield sse_event({**header, "choices": [], "usage": usage(num_prompt, generations)})
        yield SSE_DONE
    finally:
        close_all(generations)
