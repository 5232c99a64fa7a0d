"""Structured outputs and tool calls end to end: `justapi serve` with SmolLM2 (one server for
the file), real grammars over the real vocabulary. Every reply that ends with "stop" parses and
validates (the jsonschema package judges), regex and choice constraints hold, required tool
calls parse and validate, a streamed call assembles into the non-streamed one, and the official
client's parse helpers work. On the shared real-world corpora (skipped where absent): a sample
of SchemaStore schemas, best effort and strict, whose finished replies break no keyword but
the approximated ones; BFCL cases whose required replies all carry calls that validate; and
streamed tool replies equal to whole ones call for call, cut-off replies included."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from justapi.structured.schema_plan import plan_schema
from tools.corpora import corpora_dir, schema_cases, tool_cases
from tools.harness import ServedPool

pytestmark = pytest.mark.slow

MAX_TOKENS = 80
WORD = {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "y": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}
SCHEMAS = {
    "nested objects": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"name": WORD, "address": {
            "type": "object", "properties": {"city": WORD,
                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
                 "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                   "maxItems": 4}},
        "required": ["tags", "scores"], "additionalProperties": False},
    "enum and const": {"type": "object", "properties": {
        "size": {"enum": ["small", "medium", "large"]}, "kind": {"const": "shirt"},
        "in_stock": {"type": "boolean"}}, "required": ["size", "kind", "in_stock"],
        "additionalProperties": False},
    "patterns": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "date": {"type": "string", "format": "date"}},
        "required": ["code", "date"], "additionalProperties": False},
    "numeric bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "floor": {"type": "integer", "exclusiveMinimum": -3, "maximum": 3}},
        "required": ["age", "ratio", "floor"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 100}, WORD, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False},
    "oneOf": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"},
                                          "radius": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
         "required": ["kind", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"},
                                          "side": {"type": "integer", "minimum": 1,
                                                   "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False},
    "$ref": {"$defs": {"point": POINT}, "type": "object", "properties": {
        "start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "optional keys": {"type": "object", "properties": {
        "title": WORD, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["title"], "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city": WORD, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": WORD},
                   "required": ["zone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def pool():
    with ServedPool("--pool-blocks", "512", "--log-level", "warning") as served:
        yield served


def _post(pool, route: str, body: dict) -> dict:
    response = httpx.post(f"{pool.base_url}{route}", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _all(pool, route: str, bodies: list[dict]) -> list[dict]:
    """The requests at once (batched by the server), answers in order."""
    with ThreadPoolExecutor(len(bodies)) as threads:
        return list(threads.map(lambda body: _post(pool, route, body), bodies))


def test_every_stopped_reply_validates_against_its_schema(pool):
    bodies = [{"messages": [{"role": "user", "content": f"Give an example JSON object ({name})."}],
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema}},
               "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": index}
              for index, (name, schema) in enumerate(SCHEMAS.items())]
    bodies.append({"prompt": "A JSON object:", "json_schema": SCHEMAS["$ref"],  # llama-server's
                   "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 99})
    replies = _all(pool, "/v1/chat/completions", bodies[:-1])
    replies.append(_post(pool, "/v1/completions", bodies[-1]))
    schemas = [*SCHEMAS.values(), SCHEMAS["$ref"]]
    num_stopped = 0
    for schema, reply in zip(schemas, replies, strict=True):
        choice = reply["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(text), schema,
                                format_checker=jsonschema.FormatChecker())
            num_stopped += 1
    assert num_stopped >= len(replies) // 2, replies  # bounded schemas: most replies complete


def test_regex_and_choice_hold(pool):
    phone = "[0-9]{3}-[0-9]{4}"
    choices = ["positive", "negative", "neutral"]
    bodies = [{"prompt": "Call me at", "regex": phone, "max_tokens": 20, "temperature": 1.0,
               "seed": seed, "n": 2} for seed in range(2)]
    bodies += [{"prompt": "The review 'great food, slow service' is", "temperature": 1.0,
                "structured_outputs": {"choice": choices}, "max_tokens": 8, "seed": seed}
               for seed in range(2)]
    replies = _all(pool, "/v1/completions", bodies)
    texts = [(c["text"], c["finish_reason"]) for reply in replies for c in reply["choices"]]
    assert all(re.fullmatch(phone, text) and reason == "stop" for text, reason in texts[:4])
    assert all(text in choices and reason == "stop" for text, reason in texts[4:])


def test_tool_calls_parse_and_validate(pool):
    bodies = [{"messages": ASK_WEATHER, "tools": [WEATHER, TIME], "tool_choice": choice,
               "parallel_tool_calls": False, "max_tokens": MAX_TOKENS, "temperature": 0.8,
               "seed": seed}
              for seed, choice in enumerate(["required", "required",
                                             {"type": "function",
                                              "function": {"name": "get_time"}}])]
    bodies.append({**bodies[0], "tool_choice": "auto", "parallel_tool_calls": True,
                   "max_tokens": 32})
    replies = _all(pool, "/v1/chat/completions", bodies)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    for reply in replies[:3]:
        choice = reply["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schemas[call["function"]["name"]])
    assert replies[2]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    auto = replies[3]["choices"][0]  # text, or calls that validate
    for call in auto["message"].get("tool_calls") or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schemas[call["function"]["name"]])
    assert auto["message"].get("tool_calls") or auto["message"]["content"]


def test_streamed_tool_call_assembles_into_the_same_call(pool):
    body = {"messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = _post(pool, "/v1/chat/completions", body)["choices"][0]
    calls, finish, _ = _streamed_calls(pool, body)
    assert finish == whole["finish_reason"] == "tool_calls"
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in whole["message"]["tool_calls"]]


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[A-Za-z]{1,10}$")
    species: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=20)


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^[A-Za-z ]{1,12}$")
    unit: Literal["celsius", "fahrenheit"]


def test_openai_client_parse_and_tools_helpers(pool):
    client = openai.OpenAI(base_url=f"{pool.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=600)
    model = client.models.list().data[0].id
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet, max_tokens=MAX_TOKENS, temperature=0)
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(choice.message.parsed, Pet)
    completion = client.chat.completions.parse(
        model=model, messages=ASK_WEATHER, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS,
        temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, GetWeather)


# --------------------------------------------------------------------- the shared corpora
CORPORA = corpora_dir()
needs_corpora = pytest.mark.skipif(CORPORA is None, reason="no shared corpora beside the "
                                   "checkout (../shared/corpora, or set JUSTAPI_CORPORA)")
NUM_SAMPLE_SCHEMAS = 5
"""The smallest schemas of the corpus (their replies are short): formats, look-around
patterns, conditionals and oneOf among them."""
SAMPLE_TOOL_CASES = ("simple_python_100", "multiple_1", "parallel_0", "parallel_multiple_1")
CORPUS_MAX_TOKENS = 96


def _replies_counted(pool) -> dict[tuple[str, str], float]:
    """structured_replies_total by (kind, result)."""
    text = httpx.get(f"{pool.base_url}/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        found = re.match(r'justapi:structured_replies_total\{(.*)\} (\S+)$', line)
        if found:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1)))
            key = (labels["kind"], labels["result"])
            out[key] = out.get(key, 0.0) + float(found.group(2))
    return out


def _errors(schema: dict, text: str) -> list:
    validator = jsonschema.validators.validator_for(schema)(
        schema, format_checker=jsonschema.FormatChecker())
    return list(validator.iter_errors(json.loads(text)))


@needs_corpora
def test_corpus_schemas_best_effort_and_strict(pool):
    """Every sampled schema is accepted best effort, the header names what was approximated,
    and every finished reply breaks no keyword but those; strict replies break none."""
    cases = sorted(schema_cases(CORPORA), key=lambda c: len(json.dumps(c.schema)))
    cases = cases[:NUM_SAMPLE_SCHEMAS]
    plans = [plan_schema(case.schema, strict=False) for case in cases]
    jobs = [(case, plan, False) for case, plan in zip(cases, plans)]
    jobs += [(case, plan, True) for case, plan in zip(cases, plans) if not plan.approximated]
    assert any(plan.approximated for plan in plans) and any(strict for *_, strict in jobs)
    before = _replies_counted(pool)

    def ask(job) -> httpx.Response:
        case, _, strict = job
        return httpx.post(f"{pool.base_url}/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "user", "content": case.prompt}], "temperature": 0,
            "max_tokens": CORPUS_MAX_TOKENS, "response_format": {"type": "json_schema",
            "json_schema": {"name": "reply", "schema": case.schema, "strict": strict}}})

    with ThreadPoolExecutor(len(jobs)) as threads:
        responses = list(threads.map(ask, jobs))
    num_finished = 0
    for (case, plan, strict), response in zip(jobs, responses, strict=True):
        assert response.status_code == 200, (case.file, response.text)
        header = response.headers.get("x-schema-approximated")
        assert header == (", ".join(plan.approximated) or None), case.file
        choice = response.json()["choices"][0]
        if choice["finish_reason"] != "stop":
            continue
        num_finished += 1
        broken = {error.validator for error in _errors(case.schema, choice["message"]["content"])}
        assert broken <= (set() if strict else set(plan.approximated)), (case.file, broken)
    assert num_finished >= len(jobs) // 2, [r.json()["choices"][0] for r in responses]
    after = _replies_counted(pool)
    judged = sum(after.get(("json_schema", r), 0) - before.get(("json_schema", r), 0)
                 for r in ("valid", "invalid"))
    assert judged == num_finished  # each finished reply was judged (and counted) by the server


def _tool_case(case_id: str):
    return next(case for case in tool_cases(CORPORA) if case.id == case_id)


def _tool_body(case, max_tokens: int = CORPUS_MAX_TOKENS) -> dict:
    return {"messages": case.messages, "tools": case.tools, "tool_choice": "required",
            "max_tokens": max_tokens, "temperature": 0}


@needs_corpora
def test_corpus_required_tool_replies_carry_calls_that_validate(pool):
    cases = [_tool_case(case_id) for case_id in SAMPLE_TOOL_CASES]
    replies = _all(pool, "/v1/chat/completions", [_tool_body(case) for case in cases])
    for case, reply in zip(cases, replies, strict=True):
        choice = reply["choices"][0]
        calls = choice["message"].get("tool_calls")
        assert calls and choice["finish_reason"] in ("tool_calls", "length"), (case.id, choice)
        assert choice["message"]["content"] is None
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                parameters[call["function"]["name"]])


def _streamed_calls(pool, body: dict) -> tuple[list[tuple[str, str]], str | None, str]:
    calls, finish, content = [], None, ""
    with httpx.stream("POST", f"{pool.base_url}/v1/chat/completions", timeout=600,
                      json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls", []):
                assert delta["index"] == len(calls) and delta["id"]  # each call once, whole
                calls.append((delta["function"]["name"], delta["function"]["arguments"]))
            finish = choice["finish_reason"] or finish
    return calls, finish, content


@needs_corpora
def test_corpus_streamed_tool_replies_equal_whole_ones_even_cut_off(pool):
    case = _tool_case("parallel_0")
    whole = _post(pool, "/v1/chat/completions", _tool_body(case))
    num_tokens = whole["usage"]["completion_tokens"]
    cut = {**_tool_body(case), "max_tokens": max(2, num_tokens - 4)}  # inside the last call
    cut_reply = _post(pool, "/v1/chat/completions", cut)
    assert cut_reply["choices"][0]["finish_reason"] == "length"
    for body, reply in ((_tool_body(case), whole), (cut, cut_reply)):
        choice = reply["choices"][0]
        expected = [(c["function"]["name"], c["function"]["arguments"])
                    for c in choice["message"].get("tool_calls") or []]
        calls, finish, content = _streamed_calls(pool, body)
        assert (calls, finish, content) == (expected, choice["finish_reason"], ""), body
        assert choice["message"]["content"] is None  # no call JSON as content, cut or not
