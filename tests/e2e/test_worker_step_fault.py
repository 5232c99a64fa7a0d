"""A worker step that raises fails only the request that caused it, through the real
processes: the worker raises for every step holding a token that only one prompt has
(JUSTAPI_FAULT_TOKEN, workers/process.py), sent while five other streams decode. That stream
ends with an error event; the five that shared its failed step are retried (re-queued, then
admitted one suspect at a time) and finish with the text they give with no fault; the retries
are counted on /metrics and no KV block is held afterwards."""
from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest

from justapi.frontend.text.tokenizer import Tokenizer
from justapi.model.gguf_file import GGUFFile
from tools.harness import TINY_MODEL, ServedPool
from workers.weights.synthetic import materialize

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

POISON = "~"
PROMPTS = [f"stream {i} keeps talking about the sea" for i in range(5)]


def stream(pool: ServedPool, prompt: str, started: threading.Event | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    out: dict = {"text": "", "errors": []}
    with httpx.stream("POST", f"{pool.base_url}/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["errors"].append(event["error"]["message"])
                continue
            out["text"] += event["choices"][0].get("text") or ""
            if started is not None:
                started.set()
    return out


def test_a_step_that_raises_fails_only_its_cause(monkeypatch):
    tokenizer = Tokenizer.from_gguf(GGUFFile(materialize(TINY_MODEL)))
    (poison_id,) = tokenizer.encode(POISON)
    assert all(poison_id not in tokenizer.encode(p) for p in PROMPTS)
    monkeypatch.setenv("JUSTAPI_FAULT_TOKEN", str(poison_id))
    pool = ServedPool("--model", TINY_MODEL)
    try:
        alone = [stream(pool, p) for p in PROMPTS]  # no poison in any step: no fault
        assert all(not r["errors"] and r["text"] for r in alone)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 1) as executor:
            started = [threading.Event() for _ in PROMPTS]
            others = [executor.submit(stream, pool, p, e) for p, e in zip(PROMPTS, started)]
            assert all(e.wait(60) for e in started)  # all five decode: the poison joins their step
            bad = executor.submit(stream, pool, f"a prompt with {POISON} in it").result()
            results = [f.result() for f in others]
        assert len(bad["errors"]) == 1 and "injected fault" in bad["errors"][0]
        for got, want in zip(results, alone):
            assert not got["errors"] and got["text"] == want["text"]
        names = ["justapi:num_step_retries_total", "justapi:kv_cache_usage_perc"]
        metrics = pool.settled_metrics(names)
        assert metrics["justapi:num_step_retries_total"] >= len(PROMPTS)  # the five, then it alone
        assert metrics["justapi:kv_cache_usage_perc"] == 0.0
        assert "injected fault: token" in pool.log()
    finally:
        pool.stop()
