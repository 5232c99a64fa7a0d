"""`kill -9` of the scheduler under a streaming load, twice in a row: the launcher starts a
new scheduler each time, the workers re-attach, the frontend resubmits every open request
with the tokens it already delivered, and every client gets the uninterrupted run's output
(greedy, seeded, with penalties, constrained by a JSON schema, long prompts; `--batch-invariant`
makes a row's bits independent of how the restart re-chunks the prompts) with no error - only
a pause.
/health and /metrics count the restarts; nothing is left behind at the end."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from tools.harness import TINY_MODEL, ServedPool, child_pids, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NUM_REQUESTS = 32
MAX_TOKENS = 150
SCHEMA = {"type": "object", "properties": {
    "words": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,5}$"},
              "minItems": 100, "maxItems": 100}},
    "required": ["words"], "additionalProperties": False}


def request_body(i: int) -> tuple[str, dict]:
    """(route, body) of request i: two constrained chats (their forced tokens make them run
    faster: 3 x MAX_TOKENS keeps them open at both kills), then greedy and seeded completions,
    every fourth with penalties (they must count delivered tokens as generated); every eighth's
    prompt is ~400 tokens, which the budget chunks otherwise when 32 are resubmitted at once."""
    sampling: dict = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i}
    if i % 4 >= 2:
        sampling.update(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2)
    if i < 2:
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"list words {i}"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "words", "schema": SCHEMA}},
            "max_tokens": 3 * MAX_TOKENS, "stream": True, **sampling}
    prompt = f"request {i} goes on and on" + (" and on" * 56 if i % 8 == 7 else "")
    return "/v1/completions", {"prompt": prompt, "ignore_eos": True,
                               "max_tokens": MAX_TOKENS, "stream": True, **sampling}


class Load:
    """NUM_REQUESTS streams at once on one event loop in a thread; `events[i]` counts request
    i's SSE events (a stream whose text is held back, e.g. an incomplete UTF-8 sequence, has
    few), `done[i]` is set when it ended."""

    def __init__(self, pool: ServedPool) -> None:
        self.pool = pool
        self.events = [0] * NUM_REQUESTS
        self.done = [False] * NUM_REQUESTS
        self.open_at_kills: list[list[int]] = []  # the streams open at each kill

    async def stream(self, client: httpx.AsyncClient, i: int) -> dict:
        route, body = request_body(i)
        out: dict = {"text": "", "finish_reason": None, "errors": [], "status": None}
        async with client.stream("POST", self.pool.base_url + route, json=body) as reply:
            out["status"] = reply.status_code
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                self.events[i] += 1
                if "error" in event:
                    out["errors"].append(event["error"])
                    continue
                choice = event["choices"][0]
                delta = choice.get("delta") or {}
                out["text"] += choice.get("text") or delta.get("content") or ""
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
        self.done[i] = True
        return out

    async def _all(self) -> list[dict]:
        limits = httpx.Limits(max_connections=2 * NUM_REQUESTS)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return list(await asyncio.gather(*(self.stream(client, i)
                                               for i in range(NUM_REQUESTS))))

    def run(self, during=None) -> list[dict]:
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            results = executor.submit(asyncio.run, self._all())
            if during is not None:
                during(self)
            return results.result(timeout=240)


def wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def health(pool: ServedPool) -> dict:
    return httpx.get(f"{pool.base_url}/health", timeout=10).json()


def restarts(pool: ServedPool) -> int:
    return int(health(pool)["scheduler_restarts"])


def kill_twice(load: Load) -> None:
    """Once every stream has had an event, kill the scheduler; once its successor has sent
    the load a token per stream (in all), kill that one too."""
    pool = load.pool
    wait_for(lambda: min(load.events) >= 1 and min(load.events[:2]) >= 3)
    for attempt in (1, 2):
        load.open_at_kills.append([i for i in range(NUM_REQUESTS) if not load.done[i]])
        victim = int(health(pool)["scheduler_pid"])
        assert victim in child_pids(pool.proc.pid)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not pid_alive(victim))
        wait_for(lambda: restarts(pool) == attempt)
        seen = sum(load.events)
        wait_for(lambda: sum(load.events) >= seen + NUM_REQUESTS or all(load.done))


@pytest.mark.parametrize("layout", [(), ("--pd", "1:1")], ids=["one worker", "pd"])
def test_kill_9_of_the_scheduler_twice_under_load_loses_nothing(layout):
    """One worker, and prefill/decode disaggregation (a prefill and a decode worker sharing
    the pool: the new scheduler hands the resubmitted prompts over again)."""
    pool = ServedPool("--model", TINY_MODEL, "--pool-blocks", "2048", "--max-seqs", "32",
                      "--batch-invariant", *layout)
    try:
        expected = Load(pool).run()
        for result in expected:
            assert result["status"] == 200 and not result["errors"], result
        assert {r["finish_reason"] for r in expected} == {"length"}
        assert expected[0]["text"].startswith('{"words": ["')
        load = Load(pool)
        survived = load.run(kill_twice)
        for open_streams in load.open_at_kills:  # the kills hit the load, constrained ones too
            assert len(open_streams) >= NUM_REQUESTS // 2 and {0, 1} <= set(open_streams)
        for i, (got, want) in enumerate(zip(survived, expected)):
            assert got["status"] == 200 and not got["errors"], (i, got["errors"])
            assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"]), i
        health = httpx.get(f"{pool.base_url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["scheduler_restarts"] == 2
        assert pool.metrics(["justapi:scheduler_restarts_total"]) == {
            "justapi:scheduler_restarts_total": 2.0}
        if layout:  # the last scheduler handed the resubmitted requests to the decode worker
            assert pool.metrics(["justapi:pd_handoffs_total"])["justapi:pd_handoffs_total"] > 0
        log = pool.log()
        assert log.count("starting a new one, the frontend holds the open requests") == 2
        assert "standby scheduler taking over (restart 1)" in log  # the second one: cold
        pool.children = child_pids(pool.proc.pid)  # the schedulers started since
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.stop(signal.SIGKILL)
