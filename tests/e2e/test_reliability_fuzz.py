"""Fuzz the live HTTP API from its own OpenAPI document with schemathesis: valid and invalid
requests for every operation. No answer is a 5xx, every refusal is an OpenAI-style error
body (Anthropic-style on /v1/messages), and the server still serves (and holds no request or KV
block) afterwards."""
from __future__ import annotations

import signal
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tools.harness import TINY_MODEL, ServedPool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EXAMPLES_PER_OPERATION = 25  # per generation mode; raise it locally for a longer hunt


@pytest.fixture(scope="module")
def pool():
    # a small context bounds every generated request's work (max_tokens <= 96)
    served = ServedPool("--model", TINY_MODEL, "--pool-blocks", "256", "--max-context", "96",
                        "--max-seqs", "64")
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []


def check_answer(response, statuses: Counter, path: str) -> None:
    statuses[response.status_code] += 1
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"]
        if path.startswith("/v1/messages"):  # Anthropic's API answers in Anthropic's shape
            assert body["type"] == "error" and isinstance(error["type"], str) and error["type"]
            assert "param" not in error
        else:
            assert isinstance(error["type"], str) and "param" in error and "code" in error


def test_fuzz_every_operation_from_the_openapi_document(pool):
    schema = schemathesis.openapi.from_url(f"{pool.base_url}/openapi.json")
    statuses: Counter = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/tokenize", "/detokenize", "/health"}
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
                      database=None, suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case) -> None:
                check_answer(case.call(base_url=pool.base_url, timeout=120), statuses,
                             operation.path)

            try:
                fuzz()
            except Unsatisfiable:  # no parameters to make invalid (GET /health, /v1/models)
                assert mode is GenerationMode.NEGATIVE
    print(f"fuzzed {sum(statuses.values())} requests over {len(operations)} operations: "
          f"{dict(sorted(statuses.items()))}")
    assert statuses[200] > 0 and statuses[400] > 0
    wait_idle(pool)
    response = httpx.post(f"{pool.base_url}/v1/completions", timeout=60, json={
        "prompt": "after the fuzz", "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200


def wait_idle(pool: ServedPool, timeout_s: float = 60.0) -> None:
    """Every fuzzed request finished and gave its KV blocks back."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{pool.base_url}/metrics", timeout=10).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(("justapi:num_requests_running",
                                      "justapi:num_requests_waiting",
                                      "justapi:kv_cache_usage_perc"))}
        if values and not any(values.values()):
            return
        time.sleep(0.2)
    raise AssertionError("requests or KV blocks still held after the fuzz")
