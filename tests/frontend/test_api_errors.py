"""Every bad request gets a 400 with an OpenAI-style error body, and the server keeps serving."""
from __future__ import annotations

import pytest

from justapi.frontend.openai_models import ErrorResponse
from tests.support.api_stack import MODEL, run, serving_stack, sse_events

MAX_CONTEXT = 64
CHAT = [{"role": "user", "content": "hi"}]
LONG_PROMPT = " ".join(["word"] * 80)  # more than MAX_CONTEXT tokens

COMPLETION_CASES = [
    # (name, body, expected param)
    ("wrong type temperature", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("string max_tokens", {"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ("prompt is a number", {"prompt": 5}, "prompt"),
    ("missing prompt", {"max_tokens": 3}, "prompt"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("huge max_tokens", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ("max_tokens + prompt over context", {"prompt": "x y z", "max_tokens": MAX_CONTEXT - 1},
     "max_tokens"),
    ("prompt over context", {"prompt": LONG_PROMPT, "max_tokens": 1}, "prompt"),
    ("token prompt over context", {"prompt": [1] * MAX_CONTEXT, "max_tokens": 1}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("empty token prompt", {"prompt": []}, "prompt"),
    ("token id out of vocabulary", {"prompt": [1, 49152]}, "prompt"),
    ("negative token id", {"prompt": [-1]}, "prompt"),
    ("unknown model", {"model": "gpt-9", "prompt": "x"}, "model"),
    ("temperature out of range", {"prompt": "x", "temperature": 3000}, "temperature"),
    ("top_p zero", {"prompt": "x", "top_p": 0}, "top_p"),
    ("top_k negative", {"prompt": "x", "top_k": -5}, "top_k"),
    ("min_p above one", {"prompt": "x", "min_p": 2.0}, "min_p"),
    ("presence_penalty", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("frequency_penalty", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("repetition_penalty zero", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("negative seed", {"prompt": "x", "seed": -1}, "seed"),
    ("n zero", {"prompt": "x", "n": 0}, "n"),
    ("n too large", {"prompt": "x", "n": 1000}, "n"),
    ("empty stop string", {"prompt": "x", "stop": [""]}, "stop"),
    ("stop not strings", {"prompt": "x", "stop": [1, 2]}, "stop"),
    ("negative stop token id", {"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
    ("logprobs too many", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("echo with logprobs", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("suffix", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("logit_bias key not a token id", {"prompt": "x", "logit_bias": {"abc": 1.0}}, "logit_bias"),
    ("logit_bias negative key", {"prompt": "x", "logit_bias": {"-1": 1.0}}, "logit_bias"),
    ("logit_bias id out of vocabulary", {"prompt": "x", "logit_bias": {"49152": 1.0}},
     "logit_bias"),
    ("logit_bias huge id", {"prompt": "x", "logit_bias": {"9" * 30: 1.0}}, "logit_bias"),
    ("logit_bias out of range", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("logit_bias not a number", {"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias"),
    ("best_of", {"prompt": "x", "best_of": 3}, "best_of"),
    ("too many choices", {"prompt": ["x"] * 40, "n": 2}, "prompt"),
]

CHAT_CASES = [
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("no messages", {"messages": []}, "messages"),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("content part not text", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ("max_completion_tokens over context", {"messages": CHAT, "max_completion_tokens": 10**6},
     "max_completion_tokens"),
    ("max_tokens negative", {"messages": CHAT, "max_tokens": -2}, "max_tokens"),
    ("chat prompt over context", {"messages": [{"role": "user", "content": LONG_PROMPT}]},
     "messages"),
    ("top_logprobs without logprobs", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs too many", {"messages": CHAT, "logprobs": True, "top_logprobs": 40},
     "top_logprobs"),
    ("top_logprobs negative", {"messages": CHAT, "logprobs": True, "top_logprobs": -1},
     "top_logprobs"),
    ("logprobs not a bool", {"messages": CHAT, "logprobs": 3}, "logprobs"),
    ("tools", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("response format type", {"messages": CHAT, "response_format": {"type": "xml"}},
     "response_format.type"),
    ("unsupported schema keyword", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                               "schema": {"not": {}}}}},
     "response_format.json_schema.schema"),
    ("invalid schema", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ("two constraints", {"messages": CHAT, "response_format": {"type": "json_object"},
                         "regex": "[a-z]+"}, "regex"),
    ("tool_choice names no tool", {"messages": CHAT, "tool_choice": {
        "type": "function", "function": {"name": "f"}}, "tools": [
        {"type": "function", "function": {"name": "g"}}]}, "tool_choice.function.name"),
    ("logit_bias key not a token id", {"messages": CHAT, "logit_bias": {"5.5": 1}}, "logit_bias"),
    ("unknown model", {"model": "nope", "messages": CHAT}, "model"),
]


def _assert_error(response, param):
    # an unknown model is 404 not_found_error, as OpenAI and vLLM answer; the rest are 400
    status, kind = (404, "not_found_error") if param == "model" else (400, "invalid_request_error")
    assert response.status_code == status, response.text
    body = response.json()
    ErrorResponse.model_validate(body)
    error = body["error"]
    assert error["type"] == kind
    assert error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    return error


async def _still_serves(stack):
    response = await stack.http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_bad_completion_requests_are_400_and_the_server_keeps_serving():
    async def scenario():
        async with serving_stack(max_context=MAX_CONTEXT) as stack:
            for name, body, param in COMPLETION_CASES:
                for stream in (False, True):
                    response = await stack.http.post("/v1/completions",
                                                     json={**body, "stream": stream}
                                                     if "stream_options" not in body else body)
                    try:
                        _assert_error(response, param)
                    except AssertionError as exc:
                        raise AssertionError(f"case {name!r} (stream={stream}): {exc}") from None
            assert stack.fake.submitted == []  # nothing bad reached the scheduler
            await _still_serves(stack)
    run(scenario)


def test_bad_chat_requests_are_400():
    async def scenario():
        async with serving_stack(max_context=MAX_CONTEXT) as stack:
            for name, body, param in CHAT_CASES:
                response = await stack.http.post("/v1/chat/completions", json=body)
                try:
                    _assert_error(response, param)
                except AssertionError as exc:
                    raise AssertionError(f"case {name!r}: {exc}") from None
            assert stack.fake.submitted == []
            await _still_serves(stack)
    run(scenario)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x",}'])
def test_malformed_json_is_400(raw):
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/completions", content=raw,
                                             headers={"content-type": "application/json"})
            error = _assert_error(response, None)
            assert "json" in error["message"].lower() or error["param"] is None
            await _still_serves(stack)
    run(scenario)


def test_messages_name_the_bad_value():
    async def scenario():
        async with serving_stack(max_context=MAX_CONTEXT) as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "x", "top_p": 2})
            assert "top_p" in response.json()["error"]["message"]
            assert "2" in response.json()["error"]["message"]
            response = await stack.http.post("/v1/completions", json={
                "model": "gpt-9", "prompt": "x"})
            assert response.json()["error"]["code"] == "model_not_found"
            response = await stack.http.post("/v1/completions", json={
                "prompt": "x y z", "max_tokens": 100})
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert str(MAX_CONTEXT) in error["message"]
    run(scenario)


def test_unknown_route_and_method_get_error_bodies():
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.get("/v1/nothing")
            assert response.status_code == 404
            assert response.json()["error"]["type"] == "not_found_error"
            response = await stack.http.get("/v1/completions")
            assert response.status_code == 405
            assert "error" in response.json()
    run(scenario)


def test_lost_scheduler_gives_503_on_new_requests():
    async def scenario():
        async with serving_stack() as stack:
            stack.engine.fail_all("scheduler exited")
            response = await stack.http.post("/v1/completions", json={"prompt": "x"})
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "service_unavailable_error"
    run(scenario)


def test_engine_failures_are_500_or_an_error_event():
    async def scenario():
        async with serving_stack() as stack:
            stack.fake.fail_message = "worker 0 died"
            response = await stack.http.post("/v1/completions", json={"prompt": "x",
                                                                       "max_tokens": 9})
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["type"] == "server_error" and "worker 0 died" in error["message"]
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 9, "stream": True, "n": 2})
            events = sse_events(response.content)
            assert events[-1] == "[DONE]"
            assert "worker 0 died" in events[-2]["error"]["message"]
            stack.fake.fail_message = None
            await _still_serves(stack)
    run(scenario)
