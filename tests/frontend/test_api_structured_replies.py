"""What a structured request gets back, through the real app over a fake scheduler (which
replays scripted tokens, no grammar): best-effort schemas name what they approximated (header,
/metrics); finished replies are judged against the user's own schema (counters, log); a reply
that repeats a tool call ends at the repeat; one cut by max_tokens keeps its complete calls;
streamed and whole replies agree call for call."""
from __future__ import annotations

import json
import logging

from justapi.frontend.constraints import APPROXIMATED_HEADER
from justapi.wire.protocol import SubmitRequest
from tests.support.api_stack import eventually, run, serving_stack, sse_events, tokenizer

CHAT = [{"role": "user", "content": "hi"}]
TAGS = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "kind": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}},
    "required": ["tags"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALL_A = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL_B = '{"name": "get_time", "arguments": {}}'


def _tokens(text: str, end: bool = True) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False) + (
        [tokenizer().eos_token_id] if end else [])


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_best_effort_schemas_name_what_they_approximate():
    async def scenario():
        async with serving_stack(lambda _: _tokens('{"tags": ["a"]}')) as stack:
            for route, body in (("/v1/chat/completions", {"messages": CHAT}),
                                ("/v1/completions", {"prompt": "hi"})):
                for stream in (False, True):
                    response = await stack.http.post(route, json={
                        **body, "stream": stream, "max_tokens": 20,
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "t", "schema": TAGS}}})
                    assert response.status_code == 200, response.text
                    assert response.headers[APPROXIMATED_HEADER] == "oneOf, uniqueItems"
            sent = json.loads(stack.fake.submitted[-1].sampling.structured.spec)
            assert sent["x-guidance"] == {"lenient": True, "coerce_one_of": True}
            exact = await stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 4, "json_schema": {"type": "object"}})
            assert APPROXIMATED_HEADER not in exact.headers
            tools = await stack.http.post("/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 4, "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": TAGS}}]})
            assert tools.headers[APPROXIMATED_HEADER] == "oneOf, uniqueItems"
            metrics = (await stack.http.get("/metrics")).text
            name = "justapi:structured_approximated_keywords_total"
            assert _metric(metrics, name, keyword="uniqueItems") == 5
            assert _metric(metrics, name, keyword="oneOf") == 5
    run(scenario)


def test_finished_replies_are_judged_against_the_users_schema(caplog):
    replies = iter(['{"tags": ["a", "a"]}', '{"tags": "no"}', '{"tags": ["b"'])

    def script(request: SubmitRequest) -> list[int]:
        return _tokens(next(replies))

    async def scenario():
        async with serving_stack(script) as stack:
            for max_tokens in (40, 40, 40):
                response = await stack.http.post("/v1/completions", json={
                    "prompt": "hi", "max_tokens": max_tokens,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "t", "schema": TAGS}}})
                assert response.status_code == 200
            metrics = (await stack.http.get("/metrics")).text
        name = "justapi:structured_replies_total"
        # the repeated tag breaks only the approximated uniqueItems; the other two are invalid
        assert _metric(metrics, name, kind="json_schema", mode="best_effort",
                       result="invalid") == 3
        assert _metric(metrics, name, result="valid") == 0
        assert "has non-unique elements" in caplog.text and "not of type 'array'" in caplog.text

    with caplog.at_level(logging.WARNING, logger="justapi.frontend.structured_replies"):
        run(scenario)


def _tool_reply(response) -> tuple[dict, str]:
    choice = response.json()["choices"][0]
    return choice["message"], choice["finish_reason"]


def _streamed_tool_reply(body: bytes) -> tuple[dict, str]:
    calls, content, finish = [], "", ""
    for event in sse_events(body)[:-1]:
        choice = event["choices"][0]
        content += choice["delta"].get("content") or ""
        for delta in choice["delta"].get("tool_calls", []):
            assert delta["index"] == len(calls)  # each call whole, in one delta
            calls.append(delta)
        finish = choice["finish_reason"] or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": c["type"], "function": c["function"]}
                                 for c in calls]
    return message, finish


def _without_ids(message: dict) -> dict:
    calls = [{**call, "id": ""} for call in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls} if calls else message


def test_a_repeated_call_ends_the_reply_whole_and_streamed():
    endless = '{"tool_calls": [' + ", ".join([CALL_A, CALL_B] + [CALL_A] * 30)

    async def scenario():
        async with serving_stack(lambda _: _tokens(endless, end=False),
                                 max_context=2048, tokens_per_step=2) as stack:
            body = {"messages": CHAT, "tools": [WEATHER, CLOCK], "tool_choice": "required",
                    "max_tokens": 600}
            whole = await stack.http.post("/v1/chat/completions", json=body)
            streamed = await stack.http.post("/v1/chat/completions",
                                             json={**body, "stream": True})
            message, finish = _tool_reply(whole)
            assert finish == "tool_calls" and message["content"] is None
            assert [c["function"]["arguments"] for c in message["tool_calls"]] == [
                '{"city": "Paris"}', "{}"]
            assert _without_ids(_streamed_tool_reply(streamed.content)[0]) == \
                _without_ids(message)
            assert _streamed_tool_reply(streamed.content)[1] == "tool_calls"
            assert await eventually(lambda: len(stack.fake.aborted) == 2)  # told to stop
            assert whole.json()["usage"]["completion_tokens"] < 60
            metrics = (await stack.http.get("/metrics")).text
            assert _metric(metrics, "justapi:structured_replies_total", kind="tool_calls",
                           result="valid") == 2
    run(scenario)


def test_a_reply_cut_by_max_tokens_keeps_its_complete_calls():
    text = '{"tool_calls": [' + CALL_A + ", " + CALL_B + "]}"
    cut = len(tokenizer().encode('{"tool_calls": [' + CALL_A + ', {"name": "get_',
                                 add_special_tokens=False))

    async def scenario():
        async with serving_stack(lambda _: _tokens(text), max_context=1024,
                                 tokens_per_step=3) as stack:
            for limit, expected in ((cut, ["get_weather"]), (4, [])):
                body = {"messages": CHAT, "tools": [WEATHER, CLOCK],
                        "tool_choice": "required", "max_tokens": limit}
                whole = await stack.http.post("/v1/chat/completions", json=body)
                message, finish = _tool_reply(whole)
                assert finish == "length" and message["content"] is None  # no call JSON
                assert [c["function"]["name"] for c in message.get("tool_calls", [])] == expected
                streamed = await stack.http.post("/v1/chat/completions",
                                                 json={**body, "stream": True})
                streamed_message, streamed_finish = _streamed_tool_reply(streamed.content)
                assert streamed_finish == "length"
                assert _without_ids(streamed_message) == _without_ids(message)
    run(scenario)
