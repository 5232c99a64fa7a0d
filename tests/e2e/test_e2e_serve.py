"""End-to-end: the real `justapi serve` pool (frontend, scheduler, worker processes) on a tiny
synthetic model, driven by the official openai client, raw HTTP and the ZMQ client."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from justapi.client import AsyncClient, Client
from tools.harness import TINY_MODEL, ServedPool, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def pool():
    served = ServedPool("--model", TINY_MODEL, "--zmq", f"tcp://127.0.0.1:{free_port()}",
                        "--pool-blocks", "512",
                        "--max-seqs", "64", "--max-decode", "64", "--top-k", "20")
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []


def metric(pool: ServedPool, name: str) -> float:
    text = httpx.get(f"{pool.base_url}/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def wait_idle(pool: ServedPool, timeout_s: float = 10.0) -> None:
    """Until no request runs or waits and no KV block is held by a request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (metric(pool, "justapi:num_requests_running") == 0
                and metric(pool, "justapi:num_requests_waiting") == 0
                and metric(pool, "justapi:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.2)
    raise AssertionError("the pool did not go idle: a request or its KV blocks leaked")


def greedy(oai, model_id, prompt=PROMPT, max_tokens=24, **extra):
    return oai.completions.create(model=model_id, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True, **extra})


def test_completion_and_stream_agree(oai, model_id):
    whole = greedy(oai, model_id)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    stream = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 24


def test_chat_streaming_with_usage(oai, model_id):
    stream = oai.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason == "length"]
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens > 3


def test_stop_string_is_honoured_and_not_leaked(oai, model_id):
    text = greedy(oai, model_id, max_tokens=32).choices[0].text
    start = len(text) // 2
    stop = text[start:start + 3]
    cut = greedy(oai, model_id, max_tokens=32, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert stop not in cut.choices[0].text


def test_sampling_defaults_are_announced(pool):
    """--top-k 20 (config); the synthetic GGUF carries none, so the rest are llama-server's."""
    card = httpx.get(f"{pool.base_url}/v1/models").json()["data"][0]
    assert card["sampling_defaults"] == {
        "temperature": 0.8, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0,
        "source": {"temperature": "builtin", "top_k": "config", "top_p": "builtin",
                   "min_p": "builtin", "repetition_penalty": "builtin"}}
    assert ("justapi: sampling defaults for fields a request leaves out: temperature 0.8 "
            "(builtin), top-k 20 (config), top-p 0.95 (builtin)") in pool.log()


def test_seed_reproducible_and_n_choices(oai, model_id):
    def sample(seed, n=1):
        return oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                      seed=seed, n=n, extra_body={"ignore_eos": True})

    a, b, c = sample(7), sample(7), sample(8)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text
    many = sample(7, n=3)
    texts = [choice.text for choice in many.choices]
    assert sorted(choice.index for choice in many.choices) == [0, 1, 2]
    assert len(set(texts)) == 3
    assert many.usage.completion_tokens == 48


def test_logprobs(oai, model_id):
    out = greedy(oai, model_id, max_tokens=5, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # keyed by text: byte tokens that render alike collapse
        assert chosen <= 0 and abs(chosen - max(top.values())) < 1e-4  # greedy picks the top


def test_logit_bias_forces_and_bans_tokens(pool, oai, model_id):
    def token_id(text: str) -> int:
        body = {"prompt": text, "add_special_tokens": False}
        (tid,) = httpx.post(f"{pool.base_url}/tokenize", json=body).json()["tokens"]
        return tid

    a, b = token_id("a"), token_id("b")
    forced = greedy(oai, model_id, max_tokens=6, logit_bias={str(a): 100, str(b): 50})
    assert forced.choices[0].text == "a" * 6
    banned = greedy(oai, model_id, max_tokens=6, logit_bias={str(a): -100, str(b): 50})
    assert banned.choices[0].text == "b" * 6  # without the ban, "a" would win every step
    chat = oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logit_bias={str(b): 100},
                                       extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "bbbb"


def test_concurrent_streams_match_single_runs(pool, oai, model_id):
    prompts = [f"{PROMPT} number {i} " + "word " * (i % 7) for i in range(32)]
    alone = [greedy(oai, model_id, prompt=p, max_tokens=16).choices[0].text for p in prompts]

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"{pool.base_url}/v1", api_key="x", max_retries=0)

        async def one(p):
            stream = await client.completions.create(model=model_id, prompt=p, max_tokens=16,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(p) for p in prompts))

    together = asyncio.run(run_all())
    assert together == alone
    wait_idle(pool)


def test_client_disconnect_frees_blocks(pool, model_id):
    wait_idle(pool)
    tokens_before = metric(pool, "justapi:generation_tokens_total")
    with httpx.stream("POST", f"{pool.base_url}/v1/completions", timeout=30, json={
            "model": model_id, "prompt": PROMPT, "max_tokens": 900, "stream": True,
            "ignore_eos": True, "temperature": 0}) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    wait_idle(pool)
    generated = metric(pool, "justapi:generation_tokens_total") - tokens_before
    assert 0 < generated < 900  # aborted early, and its blocks are back (wait_idle)


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400),
    (json.dumps({"prompt": PROMPT, "max_tokens": "ten"}).encode(), 400),
    (json.dumps({"prompt": PROMPT, "max_tokens": -1}).encode(), 400),
    (json.dumps({"prompt": PROMPT, "max_tokens": 10**9}).encode(), 400),
    (json.dumps({"prompt": "word " * 3000, "max_tokens": 4}).encode(), 400),
    (json.dumps({"prompt": PROMPT, "model": "no-such-model"}).encode(), 404),  # as OpenAI
    (json.dumps({"prompt": PROMPT, "temperature": -2}).encode(), 400),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(pool, oai, model_id, body,
                                                                     status):
    response = httpx.post(f"{pool.base_url}/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert greedy(oai, model_id, max_tokens=2).usage.completion_tokens == 2


def test_zmq_client_generate_abort_stats(pool, oai, model_id):
    endpoint = zmq_endpoint(pool)
    expected = greedy(oai, model_id, max_tokens=12).choices[0].text
    with Client(endpoint) as client:
        text = "".join(chunk.text for chunk in client.generate(
            PROMPT, max_tokens=12, temperature=0, ignore_eos=True))
        assert text == expected
        stream = client.generate(PROMPT, max_tokens=900, temperature=0, ignore_eos=True)
        first = next(iter(stream))
        client.abort(first.client_request_id)
        reasons = [chunk.finish_reason for chunk in stream]
        assert reasons[-1] == "abort"
        assert client.stats() is not None

    async def run_async():
        async with AsyncClient(endpoint) as aclient:
            done = await aclient.complete(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
            return done.text

    assert asyncio.run(run_async()) == expected
    wait_idle(pool)


def zmq_endpoint(pool: ServedPool) -> str:
    for line in pool.log().splitlines():
        if line.startswith("justapi: ZMQ"):
            return line.split()[2]
    raise AssertionError(f"no ZMQ endpoint in the banner:\n{pool.log()}")


def test_prefix_cache_reports_cached_tokens(oai, model_id):
    prefix = "shared system prompt " * 20
    first = greedy(oai, model_id, prompt=prefix + "first question", max_tokens=2)
    second = greedy(oai, model_id, prompt=prefix + "second question", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * 4
