"""The assembled frontend over real sockets: uvicorn + ZMQ endpoint, the official openai
client (sync, real HTTP) and justapi.client side by side, then an orderly stop."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from justapi.client import Client
from justapi.frontend.engine_client import EngineClient
from justapi.frontend.errors import ApiError
from justapi.frontend.server import FrontendServer, FrontendSettings, build_serving
from justapi.wire import transport
from tests.support.api_fake_scheduler import FakeScheduler
from tests.support.api_stack import (
    TEXTS,
    endless_script,
    eventually,
    run,
    seeded_script,
    smollm_gguf,
    tokenizer,
)


def test_frontend_server_serves_http_and_zmq_then_stops():
    def script(request):
        if request.sampling.max_tokens > 1000:
            return endless_script(request)
        return seeded_script(request)

    def use(http_url, zmq_endpoint):
        client = openai.OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "hi"}], max_tokens=50)
        with Client(zmq_endpoint, timeout_s=10) as zmq_client:
            completion = zmq_client.complete("hi", max_tokens=50)
        return chat, completion

    async def scenario():
        runtime_dir = transport.make_runtime_dir("justapi-test-")
        fake = FakeScheduler(runtime_dir, script,
                             eos_token_ids=tuple(tokenizer().eog_token_ids)).start()
        engine = EngineClient(fake.scheduler_endpoint, fake.frontend_endpoint)
        await engine.start()
        settings = FrontendSettings(fake.scheduler_endpoint, fake.frontend_endpoint,
                                    transport.ipc_endpoint(runtime_dir, "client"),
                                    model_name="tiny", max_context=8192, port=0,
                                    log_level="warning")
        serving = build_serving(smollm_gguf(), engine, settings)
        assert serving.config.max_context == 8192
        server = FrontendServer(serving, settings)
        try:
            await server.start()
            assert server.http_url.startswith("http://127.0.0.1:")
            chat, completion = await asyncio.to_thread(use, server.http_url, server.zmq_endpoint)
            assert chat.choices[0].message.content == TEXTS[0]
            assert completion.text == TEXTS[0]
            # a request still running when the frontend stops is aborted
            async with httpx.AsyncClient(base_url=server.http_url) as http:
                pending = asyncio.ensure_future(http.post("/v1/completions", json={
                    "prompt": "x", "max_tokens": 5000}, timeout=30))
                assert await eventually(lambda: engine.num_in_flight == 1)
                await server.stop()
                response = await pending
            assert response.json()["choices"][0]["finish_reason"] == "abort"
            assert fake.submitted[-1].request_id in fake.aborted
        finally:
            await server.stop()
            await engine.close()
            fake.stop()
            transport.remove_runtime_dir(runtime_dir)
    run(scenario)


def test_build_serving_takes_name_and_context_from_the_gguf():
    async def scenario():
        runtime_dir = transport.make_runtime_dir("justapi-test-")
        try:
            engine = EngineClient(transport.ipc_endpoint(runtime_dir, "s"),
                                  transport.ipc_endpoint(runtime_dir, "f"))
            serving = build_serving(smollm_gguf(), engine, FrontendSettings("", "", ""))
            assert serving.config.model_name == smollm_gguf().name
            path = Path(smollm_gguf().path)  # the file's names are accepted in `model` too
            for alias in (path.name, path.stem, str(path)):
                serving.check_model(alias)
            with pytest.raises(ApiError, match="is not served here"):
                serving.check_model("gpt-4")
            named = build_serving(smollm_gguf(), engine, FrontendSettings("", "", "", model_name="m"))
            named.check_model(smollm_gguf().name)
            assert named.config.model_name == "m"
            assert serving.config.max_context == smollm_gguf().arch_get("context_length")
            capped = build_serving(smollm_gguf(), engine, FrontendSettings(
                "", "", "", max_context=10**9))
            assert capped.config.max_context == smollm_gguf().arch_get("context_length")
            await engine.close()
        finally:
            transport.remove_runtime_dir(runtime_dir)
    run(scenario)
