"""/v1/chat/completions: messages rendered with the model's chat template -> assistant choices.

`start_chat` is the one request path every chat-like endpoint takes (/v1/responses and
/v1/messages translate their requests into a ChatCompletionRequest first): the template
renders the messages (with the request's template variables: enable_thinking,
reasoning_effort...), the output constraint or tool grammar is set (after the thinking block
for a reasoning model), and the choices start. Streams open each choice with a
`{"role": "assistant", "content": ""}` delta, like OpenAI. Each choice's text is read by
reply.py: thinking as `reasoning_content` (and `reasoning`), then content and `tool_calls`; a
reply that called ends with finish_reason "tool_calls". Owns: the chat response/chunk shapes
and chat logprobs. Does not own: limits and sampling, constraints (constraints.py, tools/), the
reading of replies (reply.py), the stream loop (sse.py).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from justapi.frontend.choices import OutputRules, collect_choices, start_choices, usage
from justapi.frontend.constraints import (
    Constraint,
    approximated_header,
    check,
    output_rules,
    request_constraint,
)
from justapi.frontend.errors import ApiError
from justapi.frontend.generation import Generation, GenerationOutput, TokenLogprob
from justapi.frontend.openai_models import ChatCompletionRequest, ChatMessage, ToolDefinition
from justapi.frontend.prompts import Prompt
from justapi.frontend.reply import AnswerWatch, ReplyReader, ReplyRules, whole_reply
from justapi.frontend.serving import Serving
from justapi.frontend.sse import stream_choices
from justapi.frontend.tools.render import chat_inputs
from justapi.frontend.tools.request import ToolPlan, tool_output_rules, tool_plan
from justapi.sampling import MAX_TOP_LOGPROBS, StructuredOutput


@dataclass
class ChatRun:
    """A started chat request: its choices and how their replies are read."""

    generations: list[Generation]
    num_prompt_tokens: int
    rules: ReplyRules
    output: OutputRules
    logprobs: int | None
    """top_logprobs width; None: no logprobs."""

    @property
    def headers(self) -> dict[str, str]:
        """The response's own headers (the schema keywords compiled as a closer form)."""
        return approximated_header(self.output.approximated)


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Validated messages -> the plain dicts the chat template takes (it joins text parts);
    a past reply's `reasoning` is given to the template as `reasoning_content`."""
    out = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        thinking = entry.pop("reasoning", None)
        if thinking is not None:
            entry.setdefault("reasoning_content", thinking)
        out.append(entry)
    return out


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


def start_chat(serving: Serving, request: ChatCompletionRequest, arrival_s: float) -> ChatRun:
    """Render, constrain and start a chat request's choices (ApiError for a bad request)."""
    serving.check_model(request.model)
    logprobs = check_supported(request)
    plan = tool_plan(request, serving.tool_format)
    prompt = request_prompt(serving, request, plan)
    rules = ReplyRules(plan, serving.reasoning, prompt.text)
    output_rules = chat_output_rules(serving, request, rules)
    param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
    requested = request.max_completion_tokens if request.max_completion_tokens is not None \
        else request.max_tokens
    limit = serving.prompts.max_tokens_for(requested, len(prompt.token_ids), param=param,
                                           prompt_param="messages")
    generations = start_choices(serving, request, [prompt], [limit], logprobs, arrival_s,
                                output=output_rules)
    return ChatRun(generations, len(prompt.token_ids), rules, output_rules, logprobs)


def request_prompt(serving: Serving, request: ChatCompletionRequest,
                   plan: ToolPlan | None) -> Prompt:
    """The request's messages through the template, with its template variables."""
    variables = serving.reasoning.template_variables(request.chat_template_kwargs,
                                                     request.reasoning_effort)
    return chat_prompt(serving, request.messages, request.tools, request.add_generation_prompt,
                       describe_tools=plan is not None, variables=variables)


async def create_chat_completion(serving: Serving, request: ChatCompletionRequest,
                                 arrival_s: float, headers: dict[str, str] | None = None
                                 ) -> dict | AsyncIterator[bytes]:
    """A full response dict, or (stream=True) an async iterator of SSE event bytes; the
    response's own headers are added to `headers`."""
    run = start_chat(serving, request, arrival_s)
    if headers is not None:
        headers.update(run.headers)
    header = {"id": serving.new_id("chatcmpl"), "object": "chat.completion",
              "created": int(time.time()), "model": serving.config.model_name}
    chunks = ChatChunks(serving, run)
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return stream_choices(run.generations, chunks, {**header, "object": "chat.completion.chunk"},
                              chunks.usage, include_usage)
    outputs = await collect_choices(serving, run.generations, run.output)
    choices = [chunks.choice(index, output) for index, output in enumerate(outputs)]
    return {**header, "choices": choices, "usage": chunks.usage()}


def chat_output_rules(serving: Serving, request: ChatCompletionRequest,
                      rules: ReplyRules) -> OutputRules:
    """The request's one output constraint: its response format, or its tool calls; for a
    reasoning model, applied after the thinking block."""
    response = request_constraint(request)
    plan = rules.plan
    if plan is None:
        if response is None:
            return OutputRules()
        return _after_thinking(rules, response, output_rules(serving.metrics.structured, response))
    if response is not None:
        raise ApiError(f"a request takes one output constraint; got tools and {response.param}",
                       param=response.param)
    tools = tool_output_rules(plan, serving.tokenizer, serving.metrics.structured)
    if tools.structured is None:
        return tools
    return _after_thinking(rules, Constraint(tools.structured, "tools"), tools)


def _after_thinking(rules: ReplyRules, constraint: Constraint,
                    output: OutputRules) -> OutputRules:
    """The output rules with the grammar applied after the thinking block, for a reasoning
    model; its watch then reads the answer alone (reply.AnswerWatch)."""
    structured = rules.reasoning.after_thinking(constraint.structured, rules.prompt_text)
    if structured is None or structured is constraint.structured:
        return output
    check(replace(constraint, structured=structured))
    watch = AnswerWatch.factory(output.watch, rules) if output.watch is not None else None
    return replace(output, structured=structured, watch=watch)


def chat_prompt(serving: Serving, messages: list[ChatMessage], tools: list[ToolDefinition] | None,
                add_generation_prompt: bool, *, describe_tools: bool,
                variables: dict | None = None) -> Prompt:
    """The messages (and tools) through the chat template, tool calls as its model writes them
    (describe_tools: calls may be made, so a template that knows no tools is told of them)."""
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools or []]
    inputs, template_tools = chat_inputs(message_dicts(messages), tool_dicts, serving.tool_format,
                                         describe_tools)
    return serving.prompts.chat_prompt(inputs, add_generation_prompt, template_tools, variables)


class ChatChunks:
    """Chat's `choices` entries: a role delta to open, then reasoning, content (and tool call)
    deltas with logprobs; or one whole choice. Counts the replies' thinking tokens."""

    def __init__(self, serving: Serving, run: ChatRun) -> None:
        self._serving = serving
        self._run = run
        self._readers: dict[int, ReplyReader] = {}
        self._reasoning_tokens: dict[int, int] = {}

    def opening(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def delta(self, index: int, output: GenerationOutput) -> dict | None:
        reader = self._readers.get(index)
        if reader is None:
            reader = self._readers[index] = self._run.rules.reader()
        parsed = reader.add(output)
        self._reasoning_tokens[index] = reader.reasoning_tokens
        delta: dict = {}
        if parsed.reasoning:
            delta = {"reasoning_content": parsed.reasoning, "reasoning": parsed.reasoning}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        if not (delta or output.logprobs or output.finish_reason):
            return None  # text held back (a possible marker or call's start)
        return {"index": index, "delta": delta, "logprobs": self.logprobs(output),
                "finish_reason": reader.finish_reason(output.finish_reason) or None}

    def choice(self, index: int, output: GenerationOutput) -> dict:
        """One whole choice of a full response."""
        reply = whole_reply(self._run.rules, output)
        self._reasoning_tokens[index] = reply.reasoning_tokens
        message: dict = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
        elif self._run.rules.plan is None:
            message["content"] = reply.content or ""
        # else a calls-only reply cut before its first call: content null, no calls
        if self._run.rules.has_reasoning:
            message["reasoning_content"] = message["reasoning"] = reply.reasoning
        return {"index": index, "message": message, "logprobs": self.logprobs(output),
                "finish_reason": reply.finish_reason or None}

    def usage(self) -> dict:
        tokens = sum(self._reasoning_tokens.values()) if self._run.rules.has_reasoning else None
        return usage([self._run.num_prompt_tokens], self._run.generations, tokens)

    def logprobs(self, output: GenerationOutput) -> dict | None:
        if self._run.logprobs is None:
            return None
        return chat_logprobs(self._serving, output.logprobs, self._run.logprobs)


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
