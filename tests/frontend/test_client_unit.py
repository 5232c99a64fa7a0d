"""The ZMQ programmatic API: client <-> frontend messages, the frontend's ROUTER endpoint, and
justapi.client's Client / AsyncClient against it (real sockets, scripted scheduler)."""
from __future__ import annotations

import asyncio
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq

from justapi.client import AsyncClient, Client, GenerationError
from justapi.frontend.zmq_server import ZmqServer
from justapi.sampling import SamplingParams
from justapi.wire import transport
from justapi.wire.codec import ProtocolError, decode, encode
from justapi.wire.protocol import (
    AbortGeneration,
    GenerationChunk,
    QueryStats,
    StatsReport,
    SubmitGeneration,
)
from tests.support.api_fake_scheduler import fake_logprob
from tests.support.api_stack import (
    MODEL,
    TEXTS,
    chat_template,
    endless_script,
    eventually,
    run,
    seeded_script,
    serving_stack,
    text_tokens,
    tokenizer,
)


def _roundtrip(message):
    return decode([bytes(frame) for frame in encode(message)])


def test_client_messages_round_trip():
    sampling = SamplingParams(max_tokens=9, temperature=0.0, seed=4, logprobs=2)
    submit = SubmitGeneration("c1", sampling, prompt_token_ids=np.asarray([3, 4], np.int32),
                              messages=[{"role": "user", "content": "x"}], stop=["a", "b"],
                              add_special_tokens=False)
    back = _roundtrip(submit)
    assert back.client_request_id == "c1" and back.sampling == sampling
    assert back.prompt_token_ids.tolist() == [3, 4] and back.prompt_token_ids.dtype == np.int32
    assert (back.messages, back.stop, back.add_special_tokens, back.prompt) == (
        [{"role": "user", "content": "x"}], ["a", "b"], False, "")
    assert _roundtrip(AbortGeneration(["c1", "c2"])) == AbortGeneration(["c1", "c2"])
    assert _roundtrip(QueryStats("q")) == QueryStats("q")
    chunk = GenerationChunk("c1", np.asarray([5, 6], np.int32), "hé", "stop", 3, 2,
                            logprobs=np.asarray([-0.5, -1.0], np.float32),
                            top_logprob_ids=np.asarray([[5, 7], [6, -1]], np.int32),
                            top_logprobs=np.asarray([[-0.5, -2], [-1, -np.inf]], np.float32),
                            error=None)
    back = _roundtrip(chunk)
    assert back.token_ids.tolist() == [5, 6] and back.text == "hé"
    assert (back.finish_reason, back.num_prompt_tokens, back.num_cached_tokens) == ("stop", 3, 2)
    assert back.top_logprob_ids.tolist() == [[5, 7], [6, -1]]
    assert back.top_logprobs[1, 1] == -np.inf
    plain = _roundtrip(GenerationChunk("c2", np.asarray([1], np.int32), "a"))
    assert plain.logprobs is None and plain.top_logprob_ids is None and plain.error is None
    report = StatsReport("q", MODEL, 128, True, [], {"num_requests_running": 1},
                         [{"worker_id": 0}], 2)
    assert _roundtrip(report) == report


def test_malformed_client_frames_are_refused():
    frames = [bytes(f) for f in encode(QueryStats("q"))]
    with pytest.raises(ProtocolError):
        decode([frames[0].replace(b"QueryStats", b"Exec")])
    with pytest.raises(ProtocolError):
        decode([b"\x80\x04\x95 pickle"])


@asynccontextmanager
async def zmq_stack(script=None, endpoint=None, curve_secret_key=None, **kwargs):
    options = {} if script is None else {"script": script}
    async with serving_stack(**options, **kwargs) as stack:
        server = ZmqServer(stack.serving,
                           endpoint or transport.ipc_endpoint(stack.runtime_dir, "client"),
                           curve_secret_key=curve_secret_key)
        task = asyncio.ensure_future(server.run())
        try:
            yield stack, server
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def test_sync_client_streams_text_and_tokens():
    def use(endpoint):
        with Client(endpoint, timeout_s=10) as client:
            chunks = list(client.generate("Say hi", max_tokens=8))
            completion = client.complete("Say hi", max_tokens=100)
            report = client.stats()
        return chunks, completion, report

    async def scenario():
        async with zmq_stack(tokens_per_step=2) as (stack, server):
            await stack.wait_healthy()
            chunks, completion, report = await asyncio.to_thread(use, server.endpoint)
            assert len(chunks) > 1
            assert all(not c.finish_reason for c in chunks[:-1])
            assert chunks[-1].finish_reason == "length"
            tokens = [t for c in chunks for t in c.token_ids.tolist()]
            assert tokens == text_tokens(0)[:8]
            assert "".join(c.text for c in chunks) == tokenizer().decode(tokens)
            assert chunks[0].num_prompt_tokens == len(tokenizer().encode("Say hi"))
            assert completion.text == TEXTS[0] and completion.finish_reason == "stop"
            assert completion.token_ids == text_tokens(0) + [tokenizer().eos_token_id]
            assert report.model_name == MODEL and report.healthy
            assert report.stats["num_requests_running"] >= 0 and report.max_context == 256
            assert stack.fake.submitted[0].sampling.max_tokens == 8
    run(scenario)


def test_sync_client_abort_and_early_close():
    def use(endpoint):
        with Client(endpoint, timeout_s=10) as client:
            stream = client.generate([1, 2, 3], max_tokens=5000)
            first = next(stream)
            client.abort(stream.request_id)
            rest = list(stream)
            with client.generate([1, 2, 3], max_tokens=5000) as second:
                next(second)  # leaving the `with` aborts it
        return first, rest

    async def scenario():
        async with zmq_stack(endless_script, max_context=10_000) as (stack, server):
            first, rest = await asyncio.to_thread(use, server.endpoint)
            assert first.finish_reason == ""
            assert rest[-1].finish_reason == "abort"
            ids = [r.request_id for r in stack.fake.submitted]
            assert await eventually(lambda: set(ids) <= set(stack.fake.aborted))
            assert await eventually(lambda: server.num_running == 0)
    run(scenario)


def test_async_client_concurrent_text_ids_messages_stop_and_logprobs():
    messages = [{"role": "user", "content": "hi"}]

    async def scenario():
        async with zmq_stack() as (stack, server):
            async with AsyncClient(server.endpoint) as client:
                results = await asyncio.gather(
                    client.complete("a prompt", max_tokens=100),
                    client.complete(prompt=[7, 8, 9], max_tokens=100, stop=["brown"]),
                    client.complete(messages=messages, max_tokens=100, seed=1),
                    client.complete("logprobs", max_tokens=3, logprobs=2))
                report = await client.stats()
            assert results[0].text == TEXTS[0]
            assert results[1].text == TEXTS[0][:TEXTS[0].index("brown")]
            assert results[1].finish_reason == "stop"
            assert results[2].text == TEXTS[1]
            assert results[3].logprobs == pytest.approx([fake_logprob(i) for i in range(3)])
            sent = {tuple(r.prompt_token_ids.tolist()) for r in stack.fake.submitted}
            rendered = tokenizer().encode(chat_template().render(messages, True),
                                          add_special_tokens=False)
            assert tuple(rendered) in sent and (7, 8, 9) in sent
            assert report.num_in_flight == 0
    run(scenario)


def test_async_client_leaving_a_stream_aborts_it():
    async def scenario():
        async with zmq_stack(endless_script, max_context=10_000) as (stack, server):
            async with AsyncClient(server.endpoint) as client:
                stream = client.generate("x", max_tokens=5000)
                async for _ in stream:
                    break
                await stream.aclose()
                request_id = stack.fake.submitted[0].request_id
                assert await eventually(lambda: request_id in stack.fake.aborted)
    run(scenario)


def test_a_vanished_client_gets_its_generations_aborted():
    async def scenario():
        async with zmq_stack(endless_script, max_context=10_000) as (stack, server):
            client = AsyncClient(server.endpoint)
            stream = client.generate("x", max_tokens=5000)
            await stream.__anext__()
            client._reader.cancel()
            client._socket.close(0)  # gone without a word, like a killed process
            request_id = stack.fake.submitted[0].request_id
            assert await eventually(lambda: request_id in stack.fake.aborted)
            assert await eventually(lambda: server.num_running == 0)
    run(scenario)


def test_bad_requests_come_back_as_errors_and_ids_are_per_client():
    async def scenario():
        async with zmq_stack(max_context=32) as (stack, server):
            async with AsyncClient(server.endpoint) as a, AsyncClient(server.endpoint) as b:
                with pytest.raises(GenerationError, match="context length"):
                    await a.complete(" ".join(["word"] * 50), max_tokens=2)
                with pytest.raises(GenerationError, match="vocabulary"):
                    await a.complete([10**6], max_tokens=2)
                with pytest.raises(GenerationError, match="role"):
                    await a.complete(messages=[{"role": "robot", "content": "x"}])
                with pytest.raises(ValueError, match="temperature"):
                    await a.complete("x", temperature=-1)
                same = await asyncio.gather(a.complete("x", max_tokens=3, request_id="r"),
                                            b.complete("x", max_tokens=3, request_id="r"))
                assert [c.finish_reason for c in same] == ["length", "length"]
            assert len(stack.fake.submitted) == 2
    run(scenario)


def test_the_documented_example_runs():
    """docs/api.md's ZMQ example, run as a separate process against the frontend endpoint."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    block = docs.split("<!-- example: zmq-client -->", 1)[1]
    code = block.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'ENDPOINT = "tcp://127.0.0.1:5555"' in code

    def script(request):
        return endless_script(request) if request.sampling.max_tokens >= 500 else \
            seeded_script(request)

    async def scenario():
        async with zmq_stack(script, max_context=4096) as (stack, server):
            await stack.wait_healthy()
            runnable = code.replace("tcp://127.0.0.1:5555", server.endpoint)
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-c", runnable, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(process.communicate(), 60)
            assert process.returncode == 0, err.decode()
            lines = out.decode().splitlines()
            assert lines[0] == tokenizer().decode(text_tokens(0)[:24])
            assert lines[1] == f"{TEXTS[0]} stop {len(text_tokens(0)) + 1} tokens"
            assert lines[2] == "ended: abort"
            assert lines[3].startswith("healthy: True running: ")
            assert lines[4:] == [f"{p!r} -> {tokenizer().decode(text_tokens(0)[:8])!r}" for p in
                                 ["One plus one is", "The sky is", "Water boils at"]]
    run(scenario)


def test_curve_encrypted_tcp_endpoint_needs_the_server_key():
    public, secret = zmq.curve_keypair()

    def use(endpoint):
        with Client(endpoint, timeout_s=10, server_public_key=public) as client:
            text = client.complete("hi", max_tokens=4).text
        with Client(endpoint, timeout_s=0.5) as plain:  # no key: the handshake never completes
            with pytest.raises(TimeoutError):
                plain.stats(timeout_s=0.5)
        return text

    async def scenario():
        async with zmq_stack(endpoint="tcp://127.0.0.1:*", curve_secret_key=secret) as (
                stack, server):
            assert server.endpoint.startswith("tcp://127.0.0.1:")
            text = await asyncio.to_thread(use, server.endpoint)
            assert text == tokenizer().decode(text_tokens(0)[:4])
            assert len(stack.fake.submitted) == 1
    run(scenario)
