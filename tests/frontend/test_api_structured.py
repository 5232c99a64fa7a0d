"""Structured outputs and tools through the real app over a fake scheduler: every vendor's
constraint field becomes the StructuredOutput the scheduler gets; bad or doubled constraints
are 400s naming the field; tool calls come back whole and streamed in OpenAI's shapes, also
through the official client's parse helpers."""
from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from justapi.client import AsyncClient, GenerationError, assemble_tool_calls
from justapi.frontend.openai_models import ChatCompletionChunk, ChatCompletionResponse
from justapi.sampling import StructuredOutput
from justapi.wire.protocol import SubmitRequest
from tests.frontend.test_client_unit import zmq_stack
from tests.support.api_stack import MODEL, run, serving_stack, sse_events, tokenizer

CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMA_TEXT = json.dumps(SCHEMA)
SENT = ("json_schema", json.dumps({**SCHEMA, "additionalProperties": False}))
"""What the scheduler gets: the object closed (it lists its properties, says nothing else)."""
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time"}}
CALL_TEXT = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "get_time", "arguments": {}}]}')

# (fields, expected (kind, spec)) for chat and completions alike
MAPPINGS = [
    ({"response_format": {"type": "json_object"}}, ("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": SCHEMA, "strict": True}}}, SENT),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}},  # llama-server
     SENT),
    ({"response_format": {"type": "json_schema", "schema": SCHEMA}}, SENT),
    ({"structured_outputs": {"json": SCHEMA}}, SENT),
    ({"structured_outputs": {"json": SCHEMA_TEXT}}, SENT),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, ("regex", "[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("gbnf", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, ("json_object", "")),
    ({"guided_json": SCHEMA}, SENT),
    ({"guided_regex": "a+"}, ("regex", "a+")),
    ({"guided_choice": ["x"]}, ("choice", '["x"]')),
    ({"guided_grammar": 'start: "a"'}, ("gbnf", 'start: "a"')),
    ({"json_schema": SCHEMA}, SENT),       # llama-server
    ({"json_schema": SCHEMA_TEXT}, SENT),  # SGLang
    ({"grammar": 'root ::= [0-9]+'}, ("gbnf", "root ::= [0-9]+")),
    ({"regex": "b+"}, ("regex", "b+")),
    ({"ebnf": 'root ::= "b"'}, ("gbnf", 'root ::= "b"')),
]

# (fields, param named by the 400)
REFUSALS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                  "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                  "schema": {
        "type": "string", "format": "bogus-format"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}},  # invalid: best effort too
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "object", "required": "a"}}, "guided_json"),
    ({"structured_outputs": {"regex": "(?=x)y"}}, "structured_outputs.regex"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": "root ::= (("}, "grammar"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"json_schema": [1, 2]}, "json_schema"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "grammar"),
]


def _structured(stack):
    sampling = stack.fake.submitted[-1].sampling
    return None if sampling.structured is None else (sampling.structured.kind,
                                                     sampling.structured.spec)


def test_every_constraint_spelling_reaches_the_scheduler():
    async def scenario():
        async with serving_stack() as stack:
            for fields, expected in MAPPINGS:
                for route, body in (("/v1/chat/completions", {"messages": CHAT}),
                                    ("/v1/completions", {"prompt": "hi"})):
                    response = await stack.http.post(route, json={**body, **fields,
                                                                  "max_tokens": 4})
                    assert response.status_code == 200, (fields, response.text)
                    assert _structured(stack) == expected, (route, fields)
    run(scenario)


def test_unsupported_or_doubled_constraints_are_400_naming_the_field():
    async def scenario():
        async with serving_stack() as stack:
            for fields, param in REFUSALS:
                for route, body in (("/v1/chat/completions", {"messages": CHAT}),
                                    ("/v1/completions", {"prompt": "hi"})):
                    response = await stack.http.post(route, json={**body, **fields})
                    assert response.status_code == 400, (fields, response.text)
                    error = response.json()["error"]
                    assert error["param"] == param, (fields, error)
                    assert error["type"] == "invalid_request_error"
            message = (await stack.http.post("/v1/completions", json={
                "prompt": "hi", **REFUSALS[0][0]})).json()["error"]["message"]
            assert "uniqueItems" in message  # names the unsupported feature
            assert not stack.fake.submitted  # nothing ran unconstrained
    run(scenario)


def _call_script(request: SubmitRequest) -> list[int]:
    return tokenizer().encode(CALL_TEXT, add_special_tokens=False) + [tokenizer().eos_token_id]


def test_tools_constrain_render_and_answer_with_tool_calls():
    async def scenario():
        async with serving_stack(_call_script, max_context=1024) as stack:
            body = {"messages": CHAT, "tools": [WEATHER_TOOL, CLOCK_TOOL],
                    "tool_choice": "required"}
            response = await stack.http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            data = response.json()
            ChatCompletionResponse.model_validate(data)
            choice = data["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["content"] is None
            calls = choice["message"]["tool_calls"]
            assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] \
                == [("function", "get_weather", '{"city": "Paris"}'),
                    ("function", "get_time", "{}")]
            assert all(c["id"].startswith("call_") for c in calls)
            assert calls[0]["id"] != calls[1]["id"]
            submitted = stack.fake.submitted[-1]
            structured = submitted.sampling.structured
            assert structured.kind == "lark"
            assert '"get_time\\", \\"arguments\\": "' in structured.spec
            assert "TEXT" not in structured.spec  # required: no free text
            prompt = tokenizer().decode(submitted.prompt_token_ids.tolist(),
                                        skip_special_tokens=False)
            assert "You can call the following tools:" in prompt and "Current weather" in prompt
            tokenized = await stack.http.post("/tokenize", json={"messages": CHAT,
                                                                 "tools": body["tools"]})
            assert tokenized.json()["tokens"] == submitted.prompt_token_ids.tolist()
            auto = await stack.http.post("/v1/chat/completions", json={
                **body, "tool_choice": "auto", "parallel_tool_calls": False})
            assert "tc_trigger[lazy]" in stack.fake.submitted[-1].sampling.structured.spec
            assert "tc_call)*" not in stack.fake.submitted[-1].sampling.structured.spec
            assert auto.json()["choices"][0]["finish_reason"] == "tool_calls"
            none = await stack.http.post("/v1/chat/completions",
                                         json={**body, "tool_choice": "none"})
            assert none.json()["choices"][0]["message"] == {"role": "assistant",
                                                            "content": CALL_TEXT}
            assert stack.fake.submitted[-1].sampling.structured is None
    run(scenario)


def test_streamed_tool_call_deltas_assemble_into_the_same_calls():
    async def scenario():
        async with serving_stack(_call_script, max_context=1024, tokens_per_step=3) as stack:
            body = {"messages": CHAT, "tools": [WEATHER_TOOL, CLOCK_TOOL], "n": 2, "seed": 1}
            whole = (await stack.http.post("/v1/chat/completions", json=body)).json()
            response = await stack.http.post("/v1/chat/completions", json={**body, "stream": True})
            events = sse_events(response.content)
            assert events[-1] == "[DONE]"
            assembled: dict[int, dict] = {0: {}, 1: {}}
            finish = {}
            for event in events[:-1]:
                ChatCompletionChunk.model_validate(event)
                choice = event["choices"][0]
                for delta in choice["delta"].get("tool_calls", []):
                    calls = assembled[choice["index"]]  # each call whole, in one delta
                    assert delta["type"] == "function" and delta["function"]["name"]
                    assert delta["index"] not in calls
                    calls[delta["index"]] = {"id": delta["id"], "type": "function",
                                             "function": dict(delta["function"])}
                assert not choice["delta"].get("content")
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
            assert finish == {0: "tool_calls", 1: "tool_calls"}
            for index in (0, 1):
                streamed = [assembled[index][i] for i in sorted(assembled[index])]
                expected = whole["choices"][index]["message"]["tool_calls"]
                strip = [{**c, "id": ""} for c in expected]
                assert [{**c, "id": ""} for c in streamed] == strip
    run(scenario)


class City(pydantic.BaseModel):
    city: str
    population: int


class GetWeather(pydantic.BaseModel):
    city: str


def _client(stack) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app))
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http,
                              max_retries=0)


def test_openai_client_parse_helpers():
    reply = {"json": '{"city": "Paris", "population": 2100000}',
             "call": '{"tool_calls": [{"name": "GetWeather", "arguments": {"city": "Oslo"}}]}'}

    def script(request: SubmitRequest) -> list[int]:
        kind = "call" if request.sampling.structured.kind == "lark" else "json"
        return tokenizer().encode(reply[kind], add_special_tokens=False) + [2]

    async def scenario():
        async with serving_stack(script, max_context=1024) as stack:
            client = _client(stack)
            completion = await client.chat.completions.parse(
                model=MODEL, messages=CHAT, response_format=City)
            assert completion.choices[0].message.parsed == City(city="Paris", population=2100000)
            sent = json.loads(stack.fake.submitted[-1].sampling.structured.spec)
            assert sent["required"] == ["city", "population"] and not sent["additionalProperties"]
            completion = await client.chat.completions.parse(
                model=MODEL, messages=CHAT, tools=[openai.pydantic_function_tool(GetWeather)])
            call = completion.choices[0].message.tool_calls[0]
            assert call.function.parsed_arguments == GetWeather(city="Oslo")
            assert completion.choices[0].finish_reason == "tool_calls"
    run(scenario)


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto",
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "not": {}}}}], "required", "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}], "required",
     "tools.0.function.parameters"),
    ([WEATHER_TOOL, WEATHER_TOOL], "auto", "tools"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400(tools, choice, param):
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": CHAT, "tools": tools, "tool_choice": choice})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
    run(scenario)


def test_tools_and_an_output_constraint_together_are_400():
    async def scenario():
        async with serving_stack() as stack:
            both = await stack.http.post("/v1/chat/completions", json={
                "messages": CHAT, "tools": [WEATHER_TOOL], "regex": "a"})
            assert both.status_code == 400 and both.json()["error"]["param"] == "regex"
            none = await stack.http.post("/v1/chat/completions", json={
                "messages": CHAT, "tools": [WEATHER_TOOL], "regex": "a", "tool_choice": "none",
                "max_tokens": 2})
            assert none.status_code == 200  # no calls asked: the regex is the one constraint
    run(scenario)


def test_a_constraint_the_engine_cannot_compile_is_400_other_failures_500():
    """A grammar naming a special token the model lacks passes the frontend's check and fails
    in the scheduler ("gbnf: ..."): still the client's fault, so a 400 naming the field."""
    grammar = "start: <|no_such_token|>"
    async def scenario():
        async with serving_stack() as stack:
            stack.fake.fail_after = 0
            stack.fake.fail_message = "gbnf: unknown special token <|no_such_token|>"
            for route, body in (("/v1/chat/completions", {"messages": CHAT}),
                                ("/v1/completions", {"prompt": "hi"})):
                response = await stack.http.post(route, json={
                    **body, "structured_outputs": {"grammar": grammar}, "max_tokens": 4})
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == "structured_outputs.grammar"
                assert "no_such_token" in error["message"]
            stack.fake.fail_message = "worker lost"  # not the constraint's: a server error
            response = await stack.http.post("/v1/completions", json={
                "prompt": "hi", "structured_outputs": {"grammar": grammar}, "max_tokens": 4})
            assert response.status_code == 500, response.text
    run(scenario)


def test_zmq_client_constraints_and_tool_calls():
    schema = StructuredOutput("json_schema", SCHEMA_TEXT)

    async def use(endpoint):
        async with AsyncClient(endpoint) as client:
            constrained = await client.complete("hi", max_tokens=4, structured=schema)
            chunks = [c async for c in client.generate(
                messages=CHAT, tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice="required",
                max_tokens=200)]
            completion = await client.complete(messages=CHAT, tools=[WEATHER_TOOL],
                                               tool_choice="auto", max_tokens=200)
            refusals = []
            for options in ({"structured": StructuredOutput("regex", "(?=a)")},
                            {"messages": CHAT, "tools": [WEATHER_TOOL],
                             "structured": schema},
                            {"messages": CHAT, "tool_choice": {"type": "function",
                                                               "function": {"name": "nope"}},
                             "tools": [WEATHER_TOOL]}):
                prompt = None if "messages" in options else "hi"
                with pytest.raises(GenerationError) as info:
                    await client.complete(prompt, max_tokens=4, **options)
                refusals.append(str(info.value))
        return constrained, chunks, completion, refusals

    async def scenario():
        async with zmq_stack(_call_script, max_context=1024) as (stack, server):
            constrained, chunks, completion, refusals = await use(server.endpoint)
            assert stack.fake.submitted[0].sampling.structured.spec == SENT[1]
            assert constrained.finish_reason == "length"
            calls = assemble_tool_calls(d for c in chunks for d in c.tool_calls)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
                ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
            assert chunks[-1].finish_reason == "tool_calls"
            assert "".join(c.text for c in chunks) == ""
            assert stack.fake.submitted[1].sampling.structured.kind == "lark"
            assert completion.finish_reason == "tool_calls" and completion.text == ""
            assert [c["function"]["name"] for c in completion.tool_calls] == [
                "get_weather", "get_time"]
            assert completion.tool_calls[0]["id"].startswith("call_")
            assert "look-around" in refusals[0]
            assert "one output constraint" in refusals[1]
            assert "nope" in refusals[2]
            assert len(stack.fake.submitted) == 3  # the refused ones never ran
    run(scenario)
