"""Reasoning on /v1/chat/completions over the real app and a scripted scheduler, with Qwen3's
real chat template: the reply's thinking comes back as reasoning_content (and reasoning),
whole and streamed alike, with its token count; tool calls are parsed from the answer only;
the request's switches reach the template; a constraint is sent to start after the thinking
(or at once where the prompt opened it); past thinking is rendered back."""
from __future__ import annotations

import json

from justapi.frontend.reasoning.request import ReasoningSetup
from justapi.frontend.text.chat_template import ChatTemplate
from justapi.frontend.tools.formats import HERMES
from justapi.wire.protocol import SubmitRequest
from tests.support.api_stack import MODEL, run, serving_stack, sse_events, tokenizer
from tests.support.chat_templates import QWEN3, WEATHER_TOOL

THOUGHT = "The user says hi.\nI will greet back."
REPLY = f"<think>{THOUGHT}</think>\n\nHello there!"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _template() -> ChatTemplate:
    return ChatTemplate(QWEN3, tokenizer().template_tokens)


def _reasoning(template_source: str = QWEN3) -> ReasoningSetup:
    return ReasoningSetup.from_template(template_source, tokenizer())


def _script(text: str):
    def script(request: SubmitRequest) -> list[int]:
        return tokenizer().encode(text, add_special_tokens=False) + [tokenizer().eos_token_id]
    return script


def _thinking_tokens(thought: str) -> int:
    """The thinking's tokens: its markers are text in SmolLM2's vocabulary, so it is counted
    by tokenizing the thinking again."""
    return len(tokenizer().encode(f"<think>{thought}</think>", add_special_tokens=False))


def _stack(text: str = REPLY, **kwargs):
    return serving_stack(_script(text), template=_template(), reasoning=_reasoning(),
                         tool_format=HERMES, max_context=1024, **kwargs)


async def _chat(stack, **body) -> dict:
    response = await stack.http.post("/v1/chat/completions",
                                     json={"model": MODEL, "messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def _streamed(stack, **body) -> tuple[dict, list[dict]]:
    response = await stack.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "stream": True,
        "stream_options": {"include_usage": True}, **body})
    assert response.status_code == 200, response.text
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    message: dict = {"reasoning_content": "", "reasoning": "", "content": ""}
    for choice in deltas[1:]:
        for key in message:
            message[key] += choice["delta"].get(key) or ""
    message["finish_reason"] = deltas[-1]["finish_reason"]
    return message, chunks


def test_thinking_is_split_off_whole_and_streamed_alike_with_its_token_count():
    async def scenario():
        async with _stack() as stack:
            whole = await _chat(stack)
            message = whole["choices"][0]["message"]
            assert message == {"role": "assistant", "content": "\n\nHello there!",
                               "reasoning_content": THOUGHT, "reasoning": THOUGHT}
            tokens = _thinking_tokens(THOUGHT)
            assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": tokens}
            streamed, chunks = await _streamed(stack)
            assert streamed == {"reasoning_content": THOUGHT, "reasoning": THOUGHT,
                                "content": "\n\nHello there!", "finish_reason": "stop"}
            assert chunks[-1]["usage"] == whole["usage"]
            assert not any("think>" in json.dumps(c) for c in chunks)  # markers never shown
    run(scenario)


def test_a_reply_that_does_not_think_has_no_reasoning():
    async def scenario():
        async with _stack("Just an answer.") as stack:
            whole = await _chat(stack)
            assert whole["choices"][0]["message"]["reasoning_content"] is None
            assert whole["choices"][0]["message"]["content"] == "Just an answer."
            assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
            streamed, _ = await _streamed(stack)
            assert streamed["content"] == "Just an answer." and not streamed["reasoning"]
    run(scenario)


def test_tool_calls_are_read_from_the_answer_after_the_thinking():
    async def scenario():
        async with _stack(f"<think>Weather: call get_weather {CALL}?</think>\n{CALL}") as stack:
            body = {"tools": [WEATHER_TOOL]}
            whole = (await _chat(stack, **body))["choices"][0]
            assert whole["finish_reason"] == "tool_calls"
            assert whole["message"]["reasoning_content"] == f"Weather: call get_weather {CALL}?"
            [call] = whole["message"]["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Bern"}'}
            streamed, chunks = await _streamed(stack, **body)
            assert streamed["reasoning_content"] == whole["message"]["reasoning_content"]
            calls = [d for c in chunks if c["choices"]
                     for d in c["choices"][0]["delta"].get("tool_calls", [])]
            assert calls[0]["function"]["name"] == "get_weather"
            assert "".join(d["function"]["arguments"] for d in calls) == '{"city": "Bern"}'
            assert streamed["finish_reason"] == "tool_calls"
    run(scenario)


def test_switches_reach_the_template_and_constraints_start_after_thinking():
    async def scenario():
        async with _stack('{"ok": true}') as stack:
            await _chat(stack, response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": SCHEMA}})
            await _chat(stack, chat_template_kwargs={"enable_thinking": False})
            await _chat(stack, reasoning_effort="none", tools=[WEATHER_TOOL],
                        tool_choice="required")
            await _chat(stack, reasoning_effort="high")
            first, off, effort_off, effort_on = stack.fake.submitted
            structured = first.sampling.structured
            assert (structured.reasoning_start, structured.reasoning_end) == ("<think>",
                                                                             "</think>")
            # best effort: listed properties and nothing said of others -> no other keys
            assert json.loads(structured.spec) == {**SCHEMA, "additionalProperties": False}
            for request in (off, effort_off):
                text = tokenizer().decode(request.prompt_token_ids.tolist(),
                                          skip_special_tokens=False)
                assert text.endswith("<think>\n\n</think>\n\n")
            assert effort_off.sampling.structured.reasoning_end == "</think>"  # tools too
            on = tokenizer().decode(effort_on.prompt_token_ids.tolist(), skip_special_tokens=False)
            assert on.endswith("<|im_start|>assistant\n")
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": MESSAGES, "chat_template_kwargs": {"messages": []}})
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "chat_template_kwargs"
    run(scenario)


def test_a_prompt_that_opens_thinking_starts_the_reply_inside_it():
    template = ("{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}"
                "<｜Assistant｜><think>\n{# replies close it: </think> #}")
    reply = "Short thought.</think>The answer."

    async def scenario():
        async with serving_stack(_script(reply), template=ChatTemplate(template),
                                 reasoning=_reasoning(template), max_context=1024) as stack:
            whole = await _chat(stack, response_format={"type": "json_object"})
            message = whole["choices"][0]["message"]
            assert (message["reasoning_content"], message["content"]) == ("Short thought.",
                                                                         "The answer.")
            structured = stack.fake.submitted[0].sampling.structured
            assert (structured.reasoning_start, structured.reasoning_end) == ("", "</think>")
    run(scenario)


def test_past_thinking_is_rendered_back_where_the_template_shows_it():
    async def scenario():
        async with _stack() as stack:
            call = {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}
            messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call],
                                    "reasoning": "I need the weather."},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": messages, "tools": [WEATHER_TOOL]})
            assert response.status_code == 200, response.text
            sent = stack.fake.submitted[0].prompt_token_ids.tolist()
            assert "<think>\nI need the weather.\n</think>" in tokenizer().decode(
                sent, skip_special_tokens=False)
    run(scenario)


def _replies(metrics: str) -> dict[tuple[str, str], float]:
    """justapi:structured_replies_total by (kind, result)."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("justapi:structured_replies_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:line.index("}")]
                          .replace('"', "").split(","))
            out[labels["kind"], labels["result"]] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_output_watch_reads_the_answer_alone():
    """A reasoning model's tool reply that repeats its call ends at the repeat (the same call in
    the thinking, twice, counts for nothing), and its calls are judged on the answer; a JSON
    reply after thinking that is not JSON is judged on the answer too."""
    thought = f"I could call {CALL} or {CALL} again."
    repeats = "\n".join([CALL] * 6)

    async def scenario():
        async with _stack(f"<think>{thought}</think>\n{repeats}") as stack:
            body = {"tools": [WEATHER_TOOL], "tool_choice": "required"}
            whole = await _chat(stack, **body)
            choice = whole["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["reasoning_content"] == thought
            assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == \
                ['{"city": "Bern"}']
            # ended at the second call: well before the scripted reply's end
            total = len(tokenizer().encode(f"<think>{thought}</think>\n{repeats}",
                                           add_special_tokens=False))
            assert whole["usage"]["completion_tokens"] < total - 3 * len(
                tokenizer().encode(CALL, add_special_tokens=False))
            streamed, chunks = await _streamed(stack, **body)
            assert streamed["reasoning_content"] == thought
            assert streamed["finish_reason"] == "tool_calls"
            calls = [d for c in chunks if c["choices"]
                     for d in c["choices"][0]["delta"].get("tool_calls", [])]
            assert len(calls) == 1
            metrics = (await stack.http.get("/metrics")).text
            assert _replies(metrics) == {("tool_calls", "valid"): 2}
        async with _stack('<think>Answer in JSON: {"ok": maybe}</think>\n{"ok": true}') as stack:
            body = {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "ok", "schema": SCHEMA}}}
            whole = await _chat(stack, **body)
            assert whole["choices"][0]["message"]["content"] == '\n{"ok": true}'
            metrics = (await stack.http.get("/metrics")).text
            assert _replies(metrics) == {("json_schema", "valid"): 1}
    run(scenario)
