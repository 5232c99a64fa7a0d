"""/v1/models, /tokenize, /detokenize, /health, /openapi.json, and client disconnects."""
from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from justapi.frontend.api_server import make_http_server
from justapi.frontend.openai_models import (
    DetokenizeResponse,
    HealthResponse,
    ModelList,
    TokenizeResponse,
)
from tests.support.api_stack import (
    MODEL,
    chat_template,
    endless_script,
    eventually,
    run,
    serving_stack,
    tokenizer,
)


def test_models_lists_the_served_model():
    async def scenario():
        async with serving_stack(max_context=128) as stack:
            data = (await stack.http.get("/v1/models")).json()
            ModelList.model_validate(data)
            assert [m["id"] for m in data["data"]] == [MODEL]
            assert data["data"][0]["max_model_len"] == 128
    run(scenario)


def test_tokenize_and_detokenize_round_trip():
    text = "Hello, 世界! <|im_start|>"

    async def scenario():
        async with serving_stack() as stack:
            data = (await stack.http.post("/tokenize", json={
                "model": MODEL, "prompt": text, "return_token_strs": True})).json()
            TokenizeResponse.model_validate(data)
            assert data["tokens"] == tokenizer().encode(text)
            assert data["count"] == len(data["tokens"])
            assert data["token_strs"] == [tokenizer().id_to_token(t) for t in data["tokens"]]
            back = (await stack.http.post("/detokenize", json={"tokens": data["tokens"]})).json()
            DetokenizeResponse.model_validate(back)
            assert back == {"prompt": text}
    run(scenario)


def test_tokenize_messages_uses_the_chat_template():
    messages = [{"role": "user", "content": "hi"}]

    async def scenario():
        async with serving_stack() as stack:
            data = (await stack.http.post("/tokenize", json={"messages": messages})).json()
            expected = tokenizer().encode(chat_template().render(messages, True),
                                          add_special_tokens=False)
            assert data["tokens"] == expected
            assert data["token_strs"] is None
    run(scenario)


@pytest.mark.parametrize("path, body, status", [
    ("/tokenize", {}, 400),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404),
    ("/detokenize", {"tokens": [0, 10**6]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
])
def test_tokenize_errors(path, body, status):
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post(path, json=body)
            assert response.status_code == status
            kind = "invalid_request_error" if status == 400 else "not_found_error"
            assert response.json()["error"]["type"] == kind
    run(scenario)


def test_health_follows_the_scheduler_snapshot():
    async def scenario():
        async with serving_stack() as stack:
            await stack.wait_healthy()
            response = await stack.http.get("/health")
            assert response.status_code == 200
            assert HealthResponse.model_validate(response.json()).status == "ok"
            stack.fake.healthy = False
            assert await eventually(lambda: not stack.engine.is_healthy())
            response = await stack.http.get("/health")
            assert response.status_code == 503
            body = response.json()
            assert body["status"] == "unhealthy"
            assert body["problems"] == ["worker 0: no heartbeat for 2.0s"]
            stack.fake.healthy = True
            await stack.wait_healthy()
            assert (await stack.http.get("/health")).status_code == 200
            stack.engine.fail_all("scheduler exited")
            response = await stack.http.get("/health")
            assert response.status_code == 503
            assert "scheduler" in response.json()["problems"][0]
    run(scenario)


def test_health_is_503_before_the_scheduler_speaks():
    async def scenario():
        async with serving_stack() as stack:
            stack.engine.stats = None
            response = await stack.http.get("/health")
            assert response.status_code == 503
            assert response.json()["problems"] == ["no status from the scheduler yet"]
    run(scenario)


def test_openapi_document_lists_the_api():
    async def scenario():
        async with serving_stack() as stack:
            doc = (await stack.http.get("/openapi.json")).json()
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                         "/detokenize", "/health", "/metrics"):
                assert path in doc["paths"], path
            schemas = doc["components"]["schemas"]
            assert {"CompletionRequest", "ChatCompletionRequest", "CompletionResponse",
                    "ErrorResponse"} <= set(schemas)
    run(scenario)


# ------------------------------------------------------------------ disconnects
async def _call_asgi(app, path: str, body: dict, disconnect: asyncio.Event) -> list[dict]:
    """Drive the ASGI app like a server whose client goes away when `disconnect` is set."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 1234), "server": ("test", 80)}
    body_sent = False
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("queued", [False, True])
def test_disconnect_aborts_the_scheduler_request(stream, queued):
    """Streaming or not, generating or still queued (no tokens flowing): the abort goes out
    as soon as the client is gone."""
    async def scenario():
        async with serving_stack(endless_script, max_context=100_000, step_s=0.005) as stack:
            if queued:
                stack.fake.paused.set()
            disconnect = asyncio.Event()
            call = asyncio.ensure_future(_call_asgi(stack.app, "/v1/completions", {
                "prompt": "hi", "max_tokens": 50_000, "n": 2, "stream": stream}, disconnect))
            assert await eventually(lambda: len(stack.fake.submitted) == 2)
            if not queued:
                assert await eventually(lambda: stack.engine.num_in_flight == 2)
                await asyncio.sleep(0.05)  # tokens are flowing
            disconnect.set()
            await asyncio.wait_for(call, 10)
            ids = {r.request_id for r in stack.fake.submitted}
            assert await eventually(lambda: ids <= set(stack.fake.aborted))
            assert await eventually(lambda: stack.engine.num_in_flight == 0)
    run(scenario)


def test_disconnect_over_real_uvicorn_aborts():
    async def scenario():
        async with serving_stack(endless_script, max_context=100_000) as stack:
            server = make_http_server(stack.app, "127.0.0.1", 0, log_level="warning")
            serve = asyncio.ensure_future(server._serve())  # no signal handlers in tests
            assert await eventually(lambda: server.started)
            port = server.servers[0].sockets[0].getsockname()[1]
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                    async with http.stream("POST", "/v1/completions", json={
                            "prompt": "hi", "max_tokens": 50_000, "stream": True}) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                break  # leave after the first event
                    request_id = stack.fake.submitted[0].request_id
                    assert await eventually(lambda: request_id in stack.fake.aborted)
                    ok = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
                    assert ok.json()["choices"][0]["finish_reason"] == "length"
            finally:
                server.should_exit = True
                await asyncio.wait_for(serve, 10)
    run(scenario)
