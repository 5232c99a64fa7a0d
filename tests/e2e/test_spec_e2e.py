"""End-to-end speculative decoding through `justapi serve`: with n-gram trees or a draft model the
greedy and seeded completions of concurrent requests equal those of a plain server, /metrics
exports the spec_decode counters, a bad draft model fails start-up in one line, and stopping
leaves nothing behind; SmolLM2 with --spec ngram copies a passage as plain decoding does."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools.harness import TINY_MODEL, ServedPool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NEAR_DRAFT = TINY_MODEL + ",type=Q4_0"  # the tiny model's weights in 4 bits
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "abc abc abc abc abc abc", "Once upon a time"]
COMMON = ("--model", TINY_MODEL, "--pool-blocks", "256", "--log-level", "warning")


def completions(pool: ServedPool, **params: object) -> list[str]:
    def one(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, **params}
        reply = httpx.post(f"{pool.base_url}/v1/completions", json=body, timeout=120)
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"]
    with ThreadPoolExecutor(len(PROMPTS)) as executor:  # batched together in the server
        return list(executor.map(one, PROMPTS))


def spec_metrics(pool: ServedPool) -> dict[str, float]:
    """The spec_decode figures once they hold still: the scheduler pushes its statistics to the
    frontend every half second, so a read right after a reply may miss the last steps."""
    last: dict[str, float] | None = None
    deadline = time.monotonic() + 30
    while True:
        now = _spec_metrics_once(pool)
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(1.0)  # two STATS_INTERVAL_S: a push lands between equal reads


def _spec_metrics_once(pool: ServedPool) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{pool.base_url}/metrics").text):
        for sample in family.samples:
            if "spec_decode" in sample.name:
                key = sample.name + "".join(f"{{{v}}}" for k, v in sample.labels.items()
                                            if k == "position")
                out[key] = sample.value
    return out


@pytest.fixture(scope="module")
def plain():
    with ServedPool(*COMMON) as pool:
        outputs = completions(pool), completions(pool, temperature=0.8, seed=7)
        assert not spec_metrics(pool)  # speculation off: no spec_decode figures
    return outputs


@pytest.mark.parametrize("flags", [("--spec", "ngram", "--gamma", "3", "--branch", "2"),
                                   ("--draft-model", NEAR_DRAFT, "--spec-tree", "2,2")],
                         ids=["ngram-tree", "draft-tree"])
def test_served_outputs_equal_a_plain_servers(plain, flags):
    pool = ServedPool(*COMMON, *flags)
    try:
        assert completions(pool) == plain[0]
        assert completions(pool, temperature=0.8, seed=7) == plain[1]
        metrics = spec_metrics(pool)
        assert metrics["justapi:spec_decode_num_draft_tokens_total"] > 0
        assert metrics["justapi:spec_decode_num_drafts_total"] > 0
        assert "justapi:spec_decode_mean_acceptance_length" in metrics
        if "--draft-model" in flags:
            assert metrics["justapi:spec_decode_num_accepted_tokens_per_pos_total{0}"] > 0
    finally:
        assert pool.stop(signal.SIGTERM) == 0, pool.log()
    assert pool.leftovers() == []


def test_a_draft_model_with_another_vocabulary_is_refused_at_start():
    other = "synthetic:layers=1,hidden=32,heads=2,kv_heads=1,ffn=64,vocab=300"
    result = subprocess.run([sys.executable, "-m", "justapi.cli", "serve", *COMMON,
                             "--draft-model", other], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "draft model vocabulary has 300 tokens, the model's has 384" in result.stderr


@pytest.mark.slow
def test_smollm2_copies_a_passage_with_ngram_as_plain_decoding_does(smollm2_path):
    from workers.engine import LLMEngine

    passage = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He "
               "trimmed the wick, polished the great lens, and watched the ships pass safely.")
    messages = [{"role": "user", "content": "Repeat this passage word for word:\n\n" + passage}]
    engine = LLMEngine(smollm2_path, progress=False, num_blocks=64, weights="auto")  # serve's default
    from justapi.sampling import SamplingParams
    expected = engine.generate([engine.chat_prompt(messages)],
                               SamplingParams(temperature=0.0, max_tokens=32))[0].text
    engine.close()
    with ServedPool("--spec", "ngram", "--pool-blocks", "256", "--log-level", "warning") as pool:
        reply = httpx.post(f"{pool.base_url}/v1/chat/completions", timeout=300, json={
            "messages": messages, "max_tokens": 32, "temperature": 0})
        assert reply.json()["choices"][0]["message"]["content"] == expected
        metrics = spec_metrics(pool)
        assert metrics["justapi:spec_decode_num_accepted_tokens_total"] > 10
