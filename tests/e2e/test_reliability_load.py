"""Load on a live pool (tiny synthetic model): the bounded queue (429 + Retry-After while the
accepted requests complete), 1,000 concurrent streaming clients with correct greedy outputs,
KV exhaustion (a tiny pool forces preemption; outputs equal the unpressured runs), and a
scaled-down soak (tools/bench/soak.py: disconnects and aborts, no leaked block, every request
counted in /metrics)."""
from __future__ import annotations

import asyncio
import resource
import signal
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools.bench import soak
from tools.harness import TINY_MODEL, ServedPool, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NUM_CLIENTS = 1000
PROMPTS = [f"client prompt number {i} says " + "word " * i for i in range(8)]


def metric(pool: ServedPool, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{pool.base_url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def greedy_body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def test_a_full_queue_refuses_with_429_and_accepted_requests_complete():
    with ServedPool("--model", TINY_MODEL, "--pool-blocks", "128", "--max-seqs", "2",
                    "--max-queue", "2") as pool:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=pool.base_url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=greedy_body(
                    f"overload {i}", 64)) for i in range(24)))

        responses = asyncio.run(flood())
        statuses = Counter(r.status_code for r in responses)
        assert set(statuses) == {200, 429} and statuses[200] >= 4, statuses
        for response in responses:
            if response.status_code == 200:
                assert response.json()["usage"]["completion_tokens"] == 64
            else:
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "queue_full"
        assert metric(pool, "justapi:requests_rejected_total", reason="queue_full") == \
            statuses[429]
        assert httpx.post(f"{pool.base_url}/v1/completions", timeout=60,
                          json=greedy_body("after", 4)).status_code == 200
        assert pool.stop(signal.SIGTERM) == 0
        assert pool.leftovers() == []


@pytest.fixture(scope="module")
def big_pool():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 16384), hard))  # children inherit
    served = ServedPool("--model", TINY_MODEL, "--pool-blocks", "2048", "--max-seqs", "256",
                        "--max-decode", "256", "--max-batched-tokens", "4096",
                        "--zmq", f"tcp://127.0.0.1:{free_port()}", "--log-level", "warning")
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def one_stream(client: httpx.AsyncClient, prompt: str) -> str:
    text = []
    async with client.stream("POST", "/v1/completions",
                             json=greedy_body(prompt, 8, stream=True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                text.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
    return "".join(text)


def test_a_thousand_concurrent_streaming_clients_all_complete_correctly(big_pool):
    expected = [httpx.post(f"{big_pool.base_url}/v1/completions", timeout=60,
                           json=greedy_body(p, 8)).json()["choices"][0]["text"] for p in PROMPTS]

    async def crowd() -> list[str]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 10)
        async with httpx.AsyncClient(base_url=big_pool.base_url, timeout=300,
                                     limits=limits) as client:
            return await asyncio.gather(*(one_stream(client, PROMPTS[i % len(PROMPTS)])
                                          for i in range(NUM_CLIENTS)))

    texts = asyncio.run(crowd())
    wrong = [i for i, text in enumerate(texts) if text != expected[i % len(PROMPTS)]]
    assert not wrong, f"{len(wrong)} of {NUM_CLIENTS} streams differ, e.g. #{wrong[0]}"


def test_soak_with_disconnects_and_aborts_leaks_nothing(big_pool):
    zmq = next(line.split()[2] for line in big_pool.log().splitlines()
               if line.startswith("justapi: ZMQ"))
    admin = next(line.split()[2] for line in big_pool.log().splitlines()
                 if line.startswith("justapi: admin"))
    report = asyncio.run(soak.soak(big_pool.base_url, zmq, big_pool.proc.pid, 500, 32, seed=1,
                                   admin=admin))
    print("\n".join(report.lines()))
    assert report.errors == []
    assert report.num_lost == 0 and report.metrics_finished == 500
    assert report.kv_blocks_in_use == 0 and report.invariants == "invariants hold"
    kinds = Counter(kind for kind, _ in report.outcomes.elements())
    assert all(kinds[k] > 50 for k in soak.KINDS), kinds


def test_kv_exhaustion_preempts_and_outputs_match_the_unpressured_runs():
    # 24 blocks of 16 tokens; each request needs 10 (about 40 prompt + 120 new tokens)
    with ServedPool("--model", TINY_MODEL, "--pool-blocks", "24", "--max-seqs", "8") as pool:
        prompts = [f"preempt me {i} " + "lorem ipsum dolor sit amet " * 6 for i in range(6)]
        alone = [httpx.post(f"{pool.base_url}/v1/completions", timeout=120,
                            json=greedy_body(p, 120)).json()["choices"][0]["text"]
                 for p in prompts]
        before = metric(pool, "justapi:num_preemptions_total")

        async def together() -> list[dict]:
            async with httpx.AsyncClient(base_url=pool.base_url, timeout=300) as client:
                responses = await asyncio.gather(*(client.post(
                    "/v1/completions", json=greedy_body(p, 120)) for p in prompts))
                return [r.json() for r in responses]

        results = asyncio.run(together())
        assert [r["choices"][0]["text"] for r in results] == alone
        assert all(r["usage"]["completion_tokens"] == 120 for r in results)
        assert metric(pool, "justapi:num_preemptions_total") > before
        assert pool.stop(signal.SIGTERM) == 0
        assert pool.leftovers() == []
