"""Hostile and excessive HTTP input on the real FastAPI app (in process, real ZMQ link to a fake
scheduler): body size limit (413), API key (401, constant-time, never logged or echoed),
the bounded queue (429 + Retry-After), the shutdown drain and a lost scheduler (503),
non-UTF-8 bodies, huge n / logprobs / stop lists, a 10,000-character stop string, and
prompts kept out of the logs unless --log-requests. Every refusal is an OpenAI error body
and the app keeps serving after it."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from justapi.frontend.api_server import build_app
from justapi.frontend.engine_client import EngineClient
from justapi.frontend.metrics import FrontendMetrics
from justapi.frontend.serving import Serving, ServingConfig
from justapi.wire import transport
from tests.support.api_fake_scheduler import FakeScheduler, Script
from tests.support.api_stack import (
    MODEL,
    Stack,
    chat_template,
    endless_script,
    eventually,
    run,
    seeded_script,
    tokenizer,
)

API_KEY = "sk-test-7f3a9c1e5d2b4a6f8e0c"
LIMIT = 64 * 1024


@asynccontextmanager
async def guarded_stack(script: Script = seeded_script, *, api_key: str = "",
                        max_in_flight: int = 0, log_requests: bool = False,
                        step_s: float = 0.001) -> AsyncIterator[Stack]:
    runtime_dir = transport.make_runtime_dir("justapi-test-")
    fake = FakeScheduler(runtime_dir, script, eos_token_ids=tuple(tokenizer().eog_token_ids),
                         step_s=step_s).start()
    engine = EngineClient(fake.scheduler_endpoint, fake.frontend_endpoint)
    await engine.start()
    config = ServingConfig(MODEL, 256, max_in_flight=max_in_flight, log_requests=log_requests)
    serving = Serving(engine, tokenizer(), chat_template().render, config,
                      FrontendMetrics(MODEL, lambda: engine.stats))
    app = build_app(serving, api_key=api_key, max_request_bytes=LIMIT)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://test",
                             timeout=30, headers=headers)
    try:
        yield Stack(fake, engine, serving, app, http, runtime_dir)
    finally:
        await http.aclose()
        await engine.close()
        fake.stop()
        transport.remove_runtime_dir(runtime_dir)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


async def still_serves(stack: Stack) -> None:
    response = await stack.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert response.status_code == 200, response.text


def rejected(stack: Stack, reason: str) -> float:
    for family in text_string_to_metric_families(stack.serving.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "justapi:requests_rejected_total" and \
                    sample.labels["reason"] == reason:
                return sample.value
    raise AssertionError("no justapi:requests_rejected_total series")


# ------------------------------------------------------------------------- body size
def test_oversized_bodies_get_413_declared_or_streamed():
    async def scenario():
        async with guarded_stack() as stack:
            big = orjson.dumps({"prompt": "x" * (LIMIT + 10), "max_tokens": 1})
            error = assert_openai_error(await stack.http.post(
                "/v1/completions", content=big, headers={"content-type": "application/json"}),
                413)
            assert str(LIMIT) in error["message"]
            status, body = await asgi_chunked(stack, [big[:LIMIT // 2], big[LIMIT // 2:]])
            assert status == 413 and orjson.loads(body)["error"]["message"]
            assert rejected(stack, "too_large") == 2
            ok = orjson.dumps({"prompt": "y" * (LIMIT // 2), "max_tokens": 1})
            assert (await stack.http.post("/tokenize", content=ok)).status_code != 413
            await still_serves(stack)
    run(scenario)


async def asgi_chunked(stack: Stack, chunks: list[bytes]) -> tuple[int, bytes]:
    """POST /v1/completions straight to the ASGI app as a chunked upload (no Content-Length)."""
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
               for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "server": ("test", 80),
             "client": ("127.0.0.1", 1), "headers": [(b"content-type", b"application/json"),
                                                     (b"transfer-encoding", b"chunked")]}
    await stack.app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body


# ------------------------------------------------------------------------- API key
def test_api_key_guards_every_route_but_health_and_is_never_logged(caplog):
    caplog.set_level(logging.DEBUG)

    async def scenario():
        async with guarded_stack(api_key=API_KEY) as stack:
            await still_serves(stack)
            anonymous = httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app),
                                          base_url="http://test")
            wrong_key = "sk-wrong-" + API_KEY[9:]
            for headers in ({}, {"authorization": f"Bearer {wrong_key}"},
                            {"authorization": API_KEY}, {"authorization": f"Basic {API_KEY}"}):
                for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                                     ("GET", "/openapi.json"), ("GET", "/docs"),
                                     ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                     ("POST", "/tokenize"), ("POST", "/detokenize"),
                                     ("GET", "/no/such/route")):
                    response = await anonymous.request(method, path, headers=headers,
                                                       json={"prompt": "hi"})
                    error = assert_openai_error(response, 401)
                    assert error["code"] == "invalid_api_key"
                    assert response.headers["www-authenticate"] == "Bearer"
                    assert API_KEY not in response.text and wrong_key not in response.text
            assert (await anonymous.get("/health")).status_code in (200, 503)
            assert rejected(stack, "unauthorized") == 36
            await anonymous.aclose()
            await still_serves(stack)
    run(scenario)
    assert API_KEY not in caplog.text and API_KEY[9:] not in caplog.text


def test_the_key_is_compared_in_constant_time(monkeypatch):
    import hmac

    from justapi.frontend import guards
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(guards.hmac, "compare_digest",
                        lambda a, b: calls.append((a, b)) or real(a, b))

    async def scenario():
        async with guarded_stack(api_key=API_KEY) as stack:
            assert (await stack.http.get("/v1/models")).status_code == 200
    run(scenario)
    assert calls == [(API_KEY.encode(), API_KEY.encode())]


# ------------------------------------------------------------------------- admission
def test_a_full_queue_gets_429_with_retry_after_and_admitted_requests_finish():
    async def scenario():
        async with guarded_stack(endless_script, max_in_flight=3, step_s=0.01) as stack:
            body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True}
            first = [asyncio.ensure_future(stack.http.post("/v1/completions", json=body))
                     for _ in range(3)]
            assert await eventually(lambda: stack.engine.num_in_flight == 3)
            refused = await stack.http.post("/v1/completions", json=body)
            error = assert_openai_error(refused, 429)
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert refused.headers["retry-after"] == "1"
            too_many = await stack.http.post("/v1/completions", json={**body, "n": 2})
            assert too_many.status_code == 429
            for response in await asyncio.gather(*first):
                assert response.status_code == 200
                assert response.json()["choices"][0]["finish_reason"] == "length"
            assert rejected(stack, "queue_full") == 2
            await still_serves(stack)
    run(scenario)


def test_draining_refuses_new_requests_with_503_and_health_says_so():
    async def scenario():
        async with guarded_stack() as stack:
            await stack.wait_healthy()
            stack.serving.admission.start_draining()
            response = await stack.http.post("/v1/completions", json={"prompt": "hi"})
            assert_openai_error(response, 503)
            assert response.headers["retry-after"]
            health = await stack.http.get("/health")
            assert health.status_code == 503
            assert "shutting down" in health.json()["problems"][0]
            assert rejected(stack, "draining") == 1
    run(scenario)


def test_a_lost_scheduler_turns_requests_in_flight_into_503():
    async def scenario():
        async with guarded_stack(endless_script, step_s=0.01) as stack:
            pending = asyncio.ensure_future(stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 200, "ignore_eos": True}))
            assert await eventually(lambda: stack.engine.num_in_flight == 1)
            stack.engine.fail_all("the scheduler (pid 1) exited")
            error = assert_openai_error(await pending, 503)
            assert "scheduler" in error["message"]
            assert_openai_error(await stack.http.post("/v1/completions", json={"prompt": "x"}),
                                503)
    run(scenario)


# ------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "caf\xe9", "max_tokens": 2}', None),  # latin-1, not UTF-8
    (b'\xff\xfe{\x00"\x00', None),
    (b'{"prompt": "\xed\xa0\x80"}', None),  # a UTF-16 surrogate encoded as UTF-8
    (orjson.dumps({"prompt": "hi", "n": 10**6}), "n"),
    (b'{"prompt": "hi", "n": 1180591620717411303424}', None),
    (orjson.dumps({"prompt": "hi", "logprobs": 10**6}), "logprobs"),
    (orjson.dumps({"prompt": "hi", "stop": ["s"] * 10_000}), "stop"),
    (orjson.dumps({"prompt": "hi", "stop": "x" * 10_000}), "stop"),
    (orjson.dumps({"prompt": "hi", "stop": ["x" * 10_000]}), "stop"),
    (orjson.dumps({"prompt": "hi", "stop_token_ids": list(range(10_000))}), "stop_token_ids"),
    (orjson.dumps({"prompt": "hi", "max_tokens": 10**12}), "max_tokens"),
    (orjson.dumps({"prompt": [[1, 2]] * 10_000}), "prompt"),
    (orjson.dumps({"prompt": [10**12]}), None),
    (b"[" * 10_000 + b"]" * 10_000, None),
])
def test_hostile_completion_bodies_are_refused_with_openai_errors(body, param):
    async def scenario():
        async with guarded_stack() as stack:
            response = await stack.http.post("/v1/completions", content=body,
                                             headers={"content-type": "application/json"})
            error = assert_openai_error(response, 400)
            if param is not None:
                assert error["param"] == param, error
            await still_serves(stack)
    run(scenario)


def test_hostile_chat_bodies_are_refused_with_openai_errors():
    async def scenario():
        async with guarded_stack() as stack:
            for body in ({"messages": [{"role": "user", "content": "hi"}], "n": 33},
                         {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 10**6},
                         {"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 999},
                         {"messages": [{"role": "pwn", "content": "hi"}]},
                         {"messages": [{"role": "user", "content": "hi"}] * 1000}):
                response = await stack.http.post("/v1/chat/completions", json=body)
                assert_openai_error(response, 400)
            await still_serves(stack)
    run(scenario)


# ------------------------------------------------------------------------- logs
@pytest.mark.parametrize("log_requests", [False, True])
def test_prompts_reach_the_logs_only_with_log_requests(caplog, log_requests):
    caplog.set_level(logging.DEBUG)
    marker = f"unique-prompt-marker-{log_requests}-93f1c"

    async def scenario():
        async with guarded_stack(log_requests=log_requests) as stack:
            for path, body in (("/v1/completions", {"prompt": marker, "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": [
                                   {"role": "user", "content": marker}], "max_tokens": 2})):
                assert (await stack.http.post(path, json=body)).status_code == 200
    run(scenario)
    assert (caplog.text.count(marker) >= 2) == log_requests
