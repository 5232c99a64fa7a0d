"""/v1/chat/completions: messages rendered with the model's chat template -> assistant choices.

The template comes from the GGUF (Prompts.chat_prompt); the rendered text is tokenized
without adding BOS again (the template writes it). Streams open each choice with a
`{"role": "assistant", "content": ""}` delta, like OpenAI. Owns: the chat response/chunk
shapes and chat logprobs. Does not own: limits and sampling, the stream loop (sse.py).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from justapi.frontend.choices import collect_choices, start_choices, usage
from justapi.frontend.errors import ApiError
from justapi.frontend.generation import GenerationOutput, TokenLogprob
from justapi.frontend.openai_models import ChatCompletionRequest, ChatMessage
from justapi.frontend.serving import Serving
from justapi.frontend.sse import stream_choices
from justapi.sampling import MAX_TOP_LOGPROBS


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
    prompt = serving.prompts.chat_prompt(message_dicts(request.messages),
                                         request.add_generation_prompt)
    param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
    requested = request.max_completion_tokens if request.max_completion_tokens is not None \
        else request.max_tokens
    limit = serving.prompts.max_tokens_for(requested, len(prompt.token_ids), param=param,
                                           prompt_param="messages")
    generations = start_choices(serving, request, [prompt], [limit], logprobs, arrival_s)
    header = {"id": serving.new_id("chatcmpl"), "object": "chat.completion",
              "created": int(time.time()), "model": serving.config.model_name}
    num_prompt = [len(prompt.token_ids)]
    chunks = ChatChunks(serving, logprobs)
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return stream_choices(generations, chunks, {**header, "object": "chat.completion.chunk"},
                              num_prompt, include_usage)
    outputs = await collect_choices(serving, generations)
    choices = [{"index": index, "message": {"role": "assistant", "content": output.text},
                "logprobs": chunks.logprobs(output),
                "finish_reason": output.finish_reason or None}
               for index, output in enumerate(outputs)]
    return {**header, "choices": choices, "usage": usage(num_prompt, generations)}


class ChatChunks:
    """Chat's `choices` entries: a role delta to open, then content deltas with logprobs."""

    def __init__(self, serving: Serving, logprobs: int | None) -> None:
        self._serving = serving
        self._logprobs = logprobs
        """top_logprobs width; None: the request asked for no logprobs."""

    def opening(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def delta(self, index: int, output: GenerationOutput) -> dict:
        return {"index": index, "delta": {"content": output.text} if output.text else {},
                "logprobs": self.logprobs(output), "finish_reason": output.finish_reason or None}

    def logprobs(self, output: GenerationOutput) -> dict | None:
        if self._logprobs is None:
            return None
        return chat_logprobs(self._serving, output.logprobs, self._logprobs)


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
