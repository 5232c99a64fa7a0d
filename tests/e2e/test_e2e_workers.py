"""End-to-end with two CPU workers mapping one shared KV pool: prefixes cached by one worker
serve requests on the other; outputs match; SIGTERM leaves nothing behind."""
from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from justapi.client import Client
from tools.harness import TINY_MODEL, ServedPool, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PREFIX = "a long shared system prompt that both workers will reuse " * 6


@pytest.fixture(scope="module")
def pool():
    zmq = f"tcp://127.0.0.1:{free_port()}"
    served = ServedPool("--model", TINY_MODEL, "--workers", "2", "--zmq", zmq,
                        "--pool-blocks", "512")
    served.zmq = zmq
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []


def complete(pool, prompt: str, max_tokens: int = 8) -> dict:
    response = httpx.post(f"{pool.base_url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def scheduled_tokens(pool) -> dict[int, float]:
    with Client(pool.zmq) as client:
        stats = client.stats().stats
    return {w: stats.get(f"worker_{w}_num_scheduled_tokens", 0.0) for w in (0, 1)}


def test_both_workers_serve_and_outputs_do_not_depend_on_the_worker(pool):
    prompts = [f"question number {i}: what is {i} plus {i}?" for i in range(8)]
    alone = [complete(pool, p)["choices"][0]["text"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        together = list(executor.map(lambda p: complete(pool, p)["choices"][0]["text"], prompts))
    assert together == alone
    time.sleep(1.2)  # two stats periods
    tokens = scheduled_tokens(pool)
    assert tokens[0] > 0 and tokens[1] > 0, tokens
    exported = {(s.name, s.labels["worker_id"]): s.value
                for f in text_string_to_metric_families(httpx.get(f"{pool.base_url}/metrics").text)
                for s in f.samples if s.name.startswith("justapi:worker_s")}
    for worker_id in ("0", "1"):  # the same counters on /metrics, per worker
        assert exported[("justapi:worker_scheduled_tokens_total", worker_id)] >= tokens[int(worker_id)] > 0
        assert exported[("justapi:worker_steps_total", worker_id)] > 0


def test_prefix_cached_by_one_worker_serves_the_other(pool):
    complete(pool, PREFIX + "warm the cache")
    time.sleep(0.6)
    before = scheduled_tokens(pool)
    # Two at once: the router spreads them over both idle workers.
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        outs = list(executor.map(lambda q: complete(pool, PREFIX + q, max_tokens=32),
                                 ["first follow-up", "second follow-up"]))
    time.sleep(0.6)
    after = scheduled_tokens(pool)
    assert after[0] > before[0] and after[1] > before[1], (before, after)
    prefix_tokens = outs[0]["usage"]["prompt_tokens"] - 16
    for out in outs:
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prefix_tokens - 16, out["usage"]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        pairs = [item.partition(b"=") for item in handle.read().split(b"\0") if item]
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        module = handle.read().split(b"\0")[2].decode()
    return {"module": module, **{k.decode(): v.decode() for k, _, v in pairs}}


def test_cpu_spin_flag_reaches_the_workers_only(pool, monkeypatch):
    """--cpu-spin N becomes the CPU workers' GOMP_SPINCOUNT (beside OMP_WAIT_POLICY=PASSIVE)
    and no other process's; under auto, this tiny model's workers (the module's pool) get
    none and sleep at barriers at once."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    auto = [_environ(pid) for pid in pool.children]
    assert sorted(e["module"] for e in auto).count("workers.process") == 2
    assert all("GOMP_SPINCOUNT" not in e for e in auto)
    with ServedPool("--model", TINY_MODEL, "--cpu-spin", "1234") as spun:
        envs = [_environ(pid) for pid in spun.children]
        workers = [e for e in envs if e["module"] == "workers.process"]
        others = [e for e in envs if e["module"] != "workers.process"]
        assert len(workers) == 1 and {"justapi.frontend.process", "justapi.scheduler.process"} \
            <= {e["module"] for e in others}
        assert workers[0]["GOMP_SPINCOUNT"] == "1234"
        assert workers[0]["OMP_WAIT_POLICY"] == "PASSIVE"
        assert all("GOMP_SPINCOUNT" not in e for e in others)
        assert complete(spun, "hello there")["usage"]["completion_tokens"] == 8
