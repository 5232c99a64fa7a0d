"""/v1/responses and /v1/messages over the real app and a scripted scheduler (Qwen3's template,
so replies think and call tools in the Hermes format), driven by the official clients over
ASGI: a conversation in either API renders the very prompt its chat equivalent does (items,
calls, results, past thinking); a reply becomes the same output items / content blocks whole
and streamed (the clients' own stream accumulators accept the events); errors name each API's
fields, in each API's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai

from justapi.frontend.reasoning.request import ReasoningSetup
from justapi.frontend.text.chat_template import ChatTemplate
from justapi.frontend.tools.formats import HERMES
from justapi.wire.protocol import SubmitRequest
from tests.support.api_stack import MODEL, run, serving_stack, tokenizer
from tests.support.chat_templates import QWEN3

THOUGHT = "Paris weather: ask the tool."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                              "parameters": PARAMETERS}}


def _script(text: str):
    def script(request: SubmitRequest) -> list[int]:
        return tokenizer().encode(text, add_special_tokens=False) + [tokenizer().eos_token_id]
    return script


def _stack(text: str):
    return serving_stack(_script(text), template=ChatTemplate(QWEN3, tokenizer().template_tokens),
                         reasoning=ReasoningSetup.from_template(QWEN3, tokenizer()),
                         tool_format=HERMES, max_context=2048)


def _http(stack) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app))


def _openai(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused",
                              http_client=_http(stack), max_retries=0)


def _anthropic(stack) -> anthropic.AsyncAnthropic:
    import httpx2  # the anthropic client's own HTTP package (an httpx fork)

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=stack.app))
    return anthropic.AsyncAnthropic(base_url="http://test", api_key="unused", http_client=http,
                                    max_retries=0)


def _prompt_text(request: SubmitRequest) -> str:
    return tokenizer().decode(request.prompt_token_ids.tolist(), skip_special_tokens=False)


def _chat_call(arguments: str = '{"city": "Paris"}') -> dict:
    return {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}


def test_responses_items_render_the_prompt_of_their_chat_conversation():
    async def scenario():
        async with _stack("Fine.") as stack:
            client = _openai(stack)
            await client.responses.create(
                model=MODEL, instructions="Be brief.", tools=[{"type": "function",
                "name": "get_weather", "description": "Weather", "parameters": PARAMETERS}],
                input=[{"role": "developer", "content": "Use tools."},
                       {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                       {"type": "reasoning", "id": "rs_1", "summary": [],
                        "content": [{"type": "reasoning_text", "text": THOUGHT}]},
                       {"type": "message", "role": "assistant", "content": [
                           {"type": "output_text", "text": "Checking.", "annotations": []}]},
                       {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                        "arguments": '{"city": "Paris"}'},
                       {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
            await client.chat.completions.create(model=MODEL, tools=[CHAT_TOOL], messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [_chat_call()],
                 "reasoning_content": THOUGHT},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
            translated, chat = stack.fake.submitted
            assert _prompt_text(translated) == _prompt_text(chat)
            assert f"<think>\n{THOUGHT}\n</think>" in _prompt_text(chat)
    run(scenario)


def test_responses_output_items_whole_and_streamed():
    async def scenario():
        async with _stack(f"<think>{THOUGHT}</think>\n\n{CALL}") as stack:
            client = _openai(stack)
            tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
            whole = await client.responses.create(model=MODEL, input="Weather in Paris?",
                                                  tools=tools)
            assert [item.type for item in whole.output] == ["reasoning", "function_call"]
            assert whole.output[0].content[0].text == THOUGHT
            call = whole.output[1]
            assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
            assert call.call_id.startswith("call_") and whole.status == "completed"
            async with client.responses.stream(model=MODEL, input="Weather in Paris?",
                                               tools=tools) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_response()
            assert [item.type for item in final.output] == ["reasoning", "function_call"]
            assert final.output[0].content[0].text == THOUGHT
            assert final.output[1].arguments == call.arguments
            assert "response.function_call_arguments.delta" in kinds
            assert kinds[-1] == "response.completed"
            assert final.usage.output_tokens_details.reasoning_tokens == \
                whole.usage.output_tokens_details.reasoning_tokens > 0
    run(scenario)


def test_responses_errors_name_the_responses_fields():
    async def scenario():
        async with _stack("Fine.") as stack:
            cases = [({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
                     ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
                     ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
                     ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]},
                      "tools.0.name"),
                     ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                      "input.0.content.0")]
            for body, param in cases:
                response = await stack.http.post("/v1/responses", json={"model": MODEL, **body})
                assert response.status_code == 400, body
                assert response.json()["error"]["param"] == param, response.json()
            assert stack.fake.submitted == []
    run(scenario)


def test_messages_render_the_prompt_of_their_chat_conversation_and_count_it():
    async def scenario():
        async with _stack("Fine.") as stack:
            client = _anthropic(stack)
            tools = [{"name": "get_weather", "description": "Weather",
                      "input_schema": PARAMETERS}]
            messages = [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": THOUGHT, "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1",
                     "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "Thanks"}]}]
            await client.messages.create(model=MODEL, max_tokens=20, tools=tools,
                                         system=[{"type": "text", "text": "Be brief."}],
                                         messages=messages)
            counted = await client.messages.count_tokens(
                model=MODEL, tools=tools, system="Be brief.", messages=messages)
            await stack.http.post("/v1/chat/completions", json={"tools": [CHAT_TOOL], "messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [_chat_call()],
                 "reasoning_content": THOUGHT},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "Thanks"}]})
            translated, chat = stack.fake.submitted
            assert _prompt_text(translated) == _prompt_text(chat)
            assert counted.input_tokens == len(chat.prompt_token_ids)
    run(scenario)


def test_messages_content_blocks_whole_and_streamed():
    async def scenario():
        async with _stack(f"<think>{THOUGHT}</think>\n\n{CALL}") as stack:
            client = _anthropic(stack)
            tools = [{"name": "get_weather", "input_schema": PARAMETERS}]
            body = {"model": MODEL, "max_tokens": 200, "tools": tools,
                    "messages": [{"role": "user", "content": "Weather in Paris?"}]}
            whole = await client.messages.create(**body)
            assert [block.type for block in whole.content] == ["thinking", "tool_use"]
            assert whole.content[0].thinking == THOUGHT
            assert whole.content[1].input == {"city": "Paris"}
            assert whole.stop_reason == "tool_use"
            async with client.messages.stream(**body) as stream:
                final = await stream.get_final_message()
            assert [b.model_dump(exclude={"id"}) for b in final.content] == \
                [b.model_dump(exclude={"id"}) for b in whole.content]
            assert final.stop_reason == "tool_use"
            assert final.usage.output_tokens_details.thinking_tokens == \
                whole.usage.output_tokens_details.thinking_tokens > 0
    run(scenario)


def test_messages_errors_take_anthropics_shape_and_fields():
    async def scenario():
        async with _stack("Fine.") as stack:
            ask = [{"role": "user", "content": "hi"}]
            cases = [({"messages": ask}, 400, "max_tokens"),
                     ({"messages": ask, "max_tokens": 10**6}, 400, "max_tokens"),
                     ({"messages": ask, "max_tokens": 5, "model": "other"}, 404, "other"),
                     ({"messages": [{"role": "user", "content": [{"type": "document"}]}],
                       "max_tokens": 5}, 400, "only text"),
                     ({"messages": ask, "max_tokens": 5, "tools": [
                         {"name": "x", "input_schema": {}, "type": "web_search_20250305"}]},
                      400, "server tools")]
            for body, status, words in cases:
                response = await stack.http.post("/v1/messages", json=body)
                assert response.status_code == status, body
                error = response.json()
                assert error["type"] == "error" and words in error["error"]["message"], error
            assert stack.fake.submitted == []
    run(scenario)
