"""End-to-end PD disaggregation on the real process pool (tiny synthetic model): `--pd 1:1` on
one shared CPU segment (zero-copy hand-off) and with `--pd-separate-pools` (decode workers copy
blocks from the prefill segment), driven by the official openai client; greedy outputs equal
the colocated pool's; SIGKILL of the decode worker mid-run and of the prefill worker
mid-prefill: every request completes, no KV block leaks, nothing is left behind."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from justapi.ops.admin_client import AdminClient
from tools.harness import TINY_MODEL, ServedPool, child_pids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# Identical scheduling settings everywhere, so prompts are computed in the same chunks.
COMMON = ("--model", TINY_MODEL, "--pool-blocks", "256", "--max-seqs", "16",
          "--chunk-size", "32", "--max-prefill", "1")
LAYOUTS = {"colocated": ("--workers", "2"), "pd": ("--pd", "1:1"),
           "pd_copy": ("--pd", "1:1", "--pd-separate-pools")}
MODEL = "synthetic-llama-2x64-f32"  # the name the tiny synthetic GGUF serves under
WAIT_S = 60.0  # upper bounds for a slow, shared machine: waits, not timing checks
PROMPTS = ["the prefill worker computes the prompt", "and the decode worker takes it from there",
           "one two three four five six seven eight nine ten " * 6, "zero-copy or copied?"]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("state"))
    old = os.environ.get("JUSTAPI_STATE_DIR")
    os.environ["JUSTAPI_STATE_DIR"] = path
    yield path
    if old is None:
        del os.environ["JUSTAPI_STATE_DIR"]
    else:
        os.environ["JUSTAPI_STATE_DIR"] = old


@pytest.fixture(scope="module")
def pools(state_dir):
    with concurrent.futures.ThreadPoolExecutor(len(LAYOUTS)) as executor:
        futures = {name: executor.submit(ServedPool, *COMMON, *args)
                   for name, args in LAYOUTS.items()}
    served = {name: future.result() for name, future in futures.items()}
    yield served
    for pool in served.values():
        pool.children = child_pids(pool.proc.pid)
        assert pool.stop(signal.SIGTERM) == 0, pool.log()
        assert pool.leftovers() == [], pool.log()  # both PD segments unlinked too


def client(pool: ServedPool) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pool.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=WAIT_S * 2)


def admin(pool: ServedPool) -> AdminClient:
    return AdminClient(f"ipc://{pool.runtime_dir}/admin.sock", timeout_s=10)


def stats(pool: ServedPool) -> dict:
    with admin(pool) as connection:
        return connection.status().stats


def metric(served: ServedPool, name: str, **labels: str) -> float:
    text = httpx.get(f"{served.base_url}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def greedy(pool: ServedPool, prompt: str, max_tokens: int = 24) -> str:
    out = client(pool).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == max_tokens
    return out.choices[0].text


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def assert_no_leaked_block(pool: ServedPool) -> None:
    with admin(pool) as connection:
        wait_for(lambda: connection.status().stats["num_requests_running"] == 0, "the end")
        figures = connection.status().stats
        assert figures["kv_blocks_in_use"] == 0 and figures["pd_num_handoffs_pending"] == 0
        assert figures["pd_num_copies_in_flight"] == 0
        assert figures["kv_blocks_free"] + figures["prefix_cache_blocks"] == figures["kv_blocks_total"]
        check = connection.check_invariants()
        assert check.ok, check.message


def worker_pid(pool: ServedPool, worker_id: int) -> int:
    with admin(pool) as connection:
        return next(w["pid"] for w in connection.status().workers if w["worker_id"] == worker_id)


def load(pool: ServedPool, num_requests: int, max_tokens: int, prompt: str):
    executor = concurrent.futures.ThreadPoolExecutor(num_requests)
    futures = [executor.submit(greedy, pool, f"{i} {prompt}", max_tokens)
               for i in range(num_requests)]
    executor.shutdown(wait=False)
    return futures


# ---------------------------------------------------------------------- serving
def test_greedy_outputs_equal_the_colocated_pool(pools):
    for prompt in PROMPTS:
        expected = greedy(pools["colocated"], prompt)
        assert greedy(pools["pd"], prompt) == expected, prompt
        assert greedy(pools["pd_copy"], prompt) == expected, prompt
    shared, copied = stats(pools["pd"]), stats(pools["pd_copy"])
    assert shared["pd_num_handoffs"] >= len(PROMPTS) and shared["pd_num_copies"] == 0  # zero-copy
    assert copied["pd_num_copies"] >= len(PROMPTS) and copied["pd_copied_bytes"] > 0
    assert "pd_num_handoffs" not in stats(pools["colocated"])
    # /metrics exports the same figures from the scheduler's periodic snapshot
    for name in ("justapi:pd_copies_total", "justapi:pd_handoff_latency_seconds_count"):
        wait_for(lambda: metric(pools["pd_copy"], name) >= len(PROMPTS), f"{name} on /metrics")


def test_openai_client_streams_chat_and_completions_through_pd(pools):
    oai = client(pools["pd"])
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 12
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert text == greedy(pools["colocated"], PROMPTS[0])


def test_repeated_system_prompt_is_prefilled_once(pools):
    system = "you are a helpful assistant who answers briefly and precisely " * 8
    for pool in (pools["pd"], pools["pd_copy"]):
        oai = client(pool)
        first = oai.completions.create(model=MODEL, prompt=system + "first?", max_tokens=4,
                                       temperature=0)
        second = oai.completions.create(model=MODEL, prompt=system + "second?", max_tokens=4,
                                        temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens >= 64


def test_health_reports_each_pool(pools):
    body = httpx.get(f"{pools['pd_copy'].base_url}/health").json()
    assert body["status"] == "ok"
    assert [(w["worker_id"], w["pool_id"], w["role"]) for w in body["workers"]] == [
        (0, 0, "prefill"), (1, 1, "decode")]
    for side in ("prefill", "decode"):
        assert metric(pools["pd"], "justapi:pd_pool_num_workers_healthy", pool=side) == 1


def test_concurrent_streams_complete_on_both_paths(pools):
    for name in ("pd", "pd_copy"):
        futures = load(pools[name], 10, 40, PROMPTS[2])
        for future in futures:
            future.result(timeout=WAIT_S * 2)
        assert_no_leaked_block(pools[name])


# ---------------------------------------------------------------------- failures
def test_sigkill_the_decode_worker_mid_run(pools):
    pool = pools["pd"]
    futures = load(pool, 6, 400, PROMPTS[0])
    wait_for(lambda: stats(pool)["pd_decode_num_requests_running"] >= 3, "decodes running")
    os.kill(worker_pid(pool, 1), signal.SIGKILL)
    for future in futures:  # re-queued, recomputed and finished by the prefill worker alone
        future.result(timeout=WAIT_S * 2)
    problem = "decode pool has no healthy worker (prefill workers serve colocated)"
    health = wait_for(lambda: (h := httpx.get(f"{pool.base_url}/health").json())["problems"] and h,
                      "/health to name the decode pool's problem")  # (pushed every 0.5 s)
    assert health["status"] == "unhealthy"
    assert problem in health["problems"]
    assert stats(pool)["num_preemptions"] >= 3
    assert len(greedy(pool, PROMPTS[1])) > 0  # still serving, colocated
    assert_no_leaked_block(pool)


def test_sigkill_the_prefill_worker_mid_prefill(pools):
    pool = pools["pd_copy"]
    long_prompt = "a long prompt is prefilled in chunks of thirty-two tokens " * 13  # ~700 tokens
    futures = load(pool, 4, 16, long_prompt)
    wait_for(lambda: stats(pool)["pd_prefill_num_requests_running"] >= 1, "a prefill running")
    preempted = stats(pool)["num_preemptions"]
    os.kill(worker_pid(pool, 0), signal.SIGKILL)
    for future in futures:  # re-queued, prefilled and decoded by the decode worker alone
        future.result(timeout=WAIT_S * 2)
    # /health shows the scheduler's figures as of its last push (every 0.5 s): the requests
    # can finish before the push that names the problem
    problem = "prefill pool has no healthy worker (decode workers serve colocated)"
    wait_for(lambda: problem in httpx.get(f"{pool.base_url}/health").json()["problems"],
             "/health to name the prefill pool's problem")
    assert stats(pool)["num_preemptions"] > preempted  # its prefill was re-queued, not lost
    assert_no_leaked_block(pool)
