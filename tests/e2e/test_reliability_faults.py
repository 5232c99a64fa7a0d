"""Process faults on a live pool: SIGTERM drains (in-flight requests finish within the grace
period, new ones get 503), SIGKILL of the scheduler with --no-restart-scheduler (requests in
flight get 503 at once, the launcher stops everything, no orphan; with restarts:
tests/e2e/test_scheduler_restart.py). SIGSTOP of a worker, caught by its missed heartbeats,
is tested end to end in tests/e2e/test_e2e_ops.py (test_sigstop_*)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from tools.harness import TINY_MODEL, ServedPool, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPT = "a long answer that is still being written when the server is asked to stop "


def role_pid(pool: ServedPool, module: str) -> int:
    for pid in pool.children:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if module.encode() in handle.read():
                return pid
    raise AssertionError(f"no {module} process")


def stream_text(pool: ServedPool, max_tokens: int, started: list, name: int = 0) -> dict:
    """A streaming completion to its end: its chunks' text, finish reason and any error.
    Each event appends `name` to `started`."""
    out: dict = {"text": "", "finish_reason": None, "error": None, "status": None}
    with httpx.stream("POST", f"{pool.base_url}/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}) as response:
        out["status"] = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            started.append(name)
            if "error" in event:
                out["error"] = event["error"]
                continue
            choice = event["choices"][0]
            out["text"] += choice["text"]
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones():
    pool = ServedPool("--model", TINY_MODEL, "--pool-blocks", "256", "--shutdown-grace-s", "60")
    try:
        expected = httpx.post(f"{pool.base_url}/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}).json()
        started: list = []
        with concurrent.futures.ThreadPoolExecutor(4) as executor:
            futures = [executor.submit(stream_text, pool, 400, started, i) for i in range(4)]
            # every stream under way (each has had 2 events) before the signal: one still on
            # its way in would rightly be refused with 503
            wait_for(lambda: all(started.count(i) >= 2 for i in range(4)))
            pool.proc.send_signal(signal.SIGTERM)
            refused = None
            while refused is None and not all(f.done() for f in futures):
                try:
                    response = httpx.post(f"{pool.base_url}/v1/completions", timeout=10,
                                          json={"prompt": "new", "max_tokens": 2})
                except httpx.TransportError:
                    break
                if response.status_code == 503:
                    refused = response
            results = [f.result() for f in futures]
        assert refused is not None, "no request was refused during the drain"
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        assert refused.headers["retry-after"]
        for result in results:  # every request in flight ran to its end
            assert result["status"] == 200 and result["error"] is None
            assert result["finish_reason"] == "length"
            assert result["text"] == expected["choices"][0]["text"]
        assert pool.proc.wait(timeout=120) == 0
        assert "refusing new requests" in pool.log()
        assert pool.leftovers() == []
    finally:
        pool.stop(signal.SIGKILL)


def test_without_restarts_a_sigkill_of_the_scheduler_fails_requests_with_503_and_stops_the_pool():
    pool = ServedPool("--model", TINY_MODEL, "--pool-blocks", "256", "--no-restart-scheduler")
    try:
        started: list = []
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            whole = executor.submit(lambda: httpx.post(
                f"{pool.base_url}/v1/completions", timeout=120, json={
                    "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}))
            streamed = executor.submit(stream_text, pool, 900, started)
            wait_for(lambda: len(started) >= 4)
            scheduler = role_pid(pool, "justapi.scheduler.process")
            os.kill(scheduler, signal.SIGKILL)
            response = whole.result(timeout=60)
            stream = streamed.result(timeout=60)
        assert response.status_code == 503, response.text
        assert "scheduler" in response.json()["error"]["message"]
        assert stream["error"] is not None and stream["finish_reason"] != "length"
        assert pool.proc.wait(timeout=60) != 0  # the launcher noticed and stopped the pool
        log = pool.log()
        assert "scheduler exited with code -9" in log
        assert not pid_alive(scheduler)
        assert pool.leftovers() == []
    finally:
        pool.stop(signal.SIGKILL)
