"""/v1/chat/completions: messages rendered with the model's chat template -> assistant choices.

The template comes from the GGUF (Prompts.chat_prompt); the rendered text is tokenized
without adding BOS again (the template writes it). Streams open each choice with a
`{"role": "assistant", "content": ""}` delta, like OpenAI. With tools, each choice's text is
parsed into content and `tool_calls` (streamed as OpenAI's deltas), and a reply that called
ends with finish_reason "tool_calls". Owns: the chat response/chunk shapes and chat logprobs.
Does not own: limits and sampling, constraints (constraints.py, tools/), the stream loop.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from justapi.frontend.choices import OutputRules, collect_choices, start_choices, usage
from justapi.frontend.constraints import approximated_header, output_rules, request_constraint
from justapi.frontend.errors import ApiError
from justapi.frontend.generation import GenerationOutput, TokenLogprob
from justapi.frontend.openai_models import ChatCompletionRequest, ChatMessage, ToolDefinition
from justapi.frontend.prompts import Prompt
from justapi.frontend.serving import Serving
from justapi.frontend.sse import stream_choices
from justapi.frontend.tools.parser import FINISH_TOOL_CALLS, ToolReply, parse_reply
from justapi.frontend.tools.render import chat_inputs
from justapi.frontend.tools.request import ToolPlan, tool_output_rules, tool_plan
from justapi.sampling import MAX_TOP_LOGPROBS
from justapi.wire.protocol import FINISH_STOP


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Validated messages -> the plain dicts the chat template takes (it joins text parts)."""
    return [message.model_dump(exclude_none=True) for message in messages]


def check_supported(request: ChatCompletionRequest) -> int | None:
    """Refuse what is not served; return the logprobs width to sample with (None: none)."""
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
                                 arrival_s: float, headers: dict[str, str] | None = None
                                 ) -> dict | AsyncIterator[bytes]:
    """A full response dict, or (stream=True) an async iterator of SSE event bytes; the
    response's own headers are added to `headers`."""
    serving.check_model(request.model)
    logprobs = check_supported(request)
    plan = tool_plan(request, serving.tool_format)
    output_rules = chat_output_rules(serving, request, plan)
    if headers is not None:
        headers.update(approximated_header(output_rules.approximated))
    prompt = chat_prompt(serving, request.messages, request.tools, request.add_generation_prompt,
                         describe_tools=plan is not None)
    param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
    requested = request.max_completion_tokens if request.max_completion_tokens is not None \
        else request.max_tokens
    limit = serving.prompts.max_tokens_for(requested, len(prompt.token_ids), param=param,
                                           prompt_param="messages")
    generations = start_choices(serving, request, [prompt], [limit], logprobs, arrival_s,
                                output=output_rules)
    header = {"id": serving.new_id("chatcmpl"), "object": "chat.completion",
              "created": int(time.time()), "model": serving.config.model_name}
    num_prompt = [len(prompt.token_ids)]
    chunks = ChatChunks(serving, logprobs, plan)
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return stream_choices(generations, chunks, {**header, "object": "chat.completion.chunk"},
                              num_prompt, include_usage)
    outputs = await collect_choices(serving, generations, output_rules)
    choices = [chunks.choice(index, output) for index, output in enumerate(outputs)]
    return {**header, "choices": choices, "usage": usage(num_prompt, generations)}


def chat_output_rules(serving: Serving, request: ChatCompletionRequest,
                      plan: ToolPlan | None) -> OutputRules:
    """The request's one output constraint: its response format, or its tool calls."""
    response = request_constraint(request)
    if plan is None:
        return output_rules(serving.metrics.structured, response)
    if response is not None:
        raise ApiError(f"a request takes one output constraint; got tools and {response.param}",
                       param=response.param)
    return tool_output_rules(plan, serving.tokenizer, serving.metrics.structured)


def chat_prompt(serving: Serving, messages: list[ChatMessage], tools: list[ToolDefinition] | None,
                add_generation_prompt: bool, *, describe_tools: bool) -> Prompt:
    """The messages (and tools) through the chat template, tool calls as its model writes them
    (describe_tools: calls may be made, so a template that knows no tools is told of them)."""
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools or []]
    inputs, template_tools = chat_inputs(message_dicts(messages), tool_dicts, serving.tool_format,
                                         describe_tools)
    return serving.prompts.chat_prompt(inputs, add_generation_prompt, template_tools)


class ChatChunks:
    """Chat's `choices` entries: a role delta to open, then content (and tool call) deltas
    with logprobs; or one whole choice."""

    def __init__(self, serving: Serving, logprobs: int | None, plan: ToolPlan | None) -> None:
        self._serving = serving
        self._logprobs = logprobs
        """top_logprobs width; None: the request asked for no logprobs."""
        self._plan = plan
        self._replies: dict[int, ToolReply] = {}

    def opening(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def delta(self, index: int, output: GenerationOutput) -> dict | None:
        if self._plan is None:
            return {"index": index, "delta": {"content": output.text} if output.text else {},
                    "logprobs": self.logprobs(output),
                    "finish_reason": output.finish_reason or None}
        reply = self._replies.setdefault(index, ToolReply(self._plan.tool_format))
        parsed = reply.add(output.text, output.finish_reason)
        delta: dict = {"content": parsed.content} if parsed.content else {}
        if parsed.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        if not (delta or output.logprobs or output.finish_reason):
            return None  # text held back (a possible call's start)
        return {"index": index, "delta": delta, "logprobs": self.logprobs(output),
                "finish_reason": reply.finish_reason(output.finish_reason) or None}

    def choice(self, index: int, output: GenerationOutput) -> dict:
        """One whole choice of a full response."""
        message: dict = {"role": "assistant", "content": output.text}
        finish_reason = output.finish_reason
        if self._plan is not None:
            content, calls = parse_reply(self._plan.tool_format, output.text, finish_reason)
            message["content"] = content
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
                finish_reason = FINISH_TOOL_CALLS if finish_reason == FINISH_STOP \
                    else finish_reason
        return {"index": index, "message": message, "logprobs": self.logprobs(output),
                "finish_reason": finish_reason or None}

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
