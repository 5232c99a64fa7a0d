"""End-to-end overlap: `justapi serve` with the next step planned while one runs gives the
same greedy tokens and finish reasons (stop tokens included) as `--no-overlap`, frees every
block, and its timelines (JUSTAPI_TIMELINE) show plans sent before the step ahead was back.
Multi-step decoding (`--decode-steps`), the other way not to wait for each step's round trip:
the same tokens and finish reasons as one step a plan, every block freed."""
from __future__ import annotations

import asyncio
import glob
import os
import signal

import pytest

from justapi.client import AsyncClient, Completion
from justapi.ops.timeline import TIMELINE_ENV, load
from tools.bench.timeline_analysis import by_step
from tools.harness import TINY_MODEL, ServedPool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPTS = [f"request {i}: " + "the quick fox " * (i % 5) for i in range(12)]


async def complete_all(endpoint: str, stops: dict[int, int]) -> list[Completion]:
    async with AsyncClient(endpoint) as client:
        return list(await asyncio.gather(*(
            client.complete(p, max_tokens=8 + i, temperature=0, ignore_eos=True,
                            stop_token_ids=[stops[i]] if i in stops else [])
            for i, p in enumerate(PROMPTS))))


def serve(*flags: str, stops: dict[int, int] | None = None,
          metrics: dict[str, float] | None = None) -> list[list[Completion]]:
    """Two rounds on one server: run to length, then with a stop token for some requests
    (given, or each one's 4th token in the first round); `metrics` gets the final counters."""
    with ServedPool("--model", TINY_MODEL, "--max-seqs", "8", *flags, zmq=True) as pool:
        assert pool.zmq is not None
        to_length = asyncio.run(complete_all(pool.zmq, {}))
        if stops is None:
            stops = {i: to_length[i].token_ids[3] for i in (1, 4, 7)}
        stopped = asyncio.run(complete_all(pool.zmq, stops))
        settled = pool.settled_metrics(["justapi:kv_cache_usage_perc",
                                        "justapi:num_multi_step_plans_total"])
        assert settled["justapi:kv_cache_usage_perc"] == 0.0
        if metrics is not None:
            metrics.update(settled)
        assert pool.stop(signal.SIGTERM) == 0, pool.log()
        assert pool.leftovers() == []
    return [to_length, stopped]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a CPU worker overlaps with a core to spare")
def test_served_tokens_are_the_same_with_and_without_overlap(tmp_path, monkeypatch):
    plain = serve("--no-overlap", "--threads", "1")
    stops = {i: plain[0][i].token_ids[3] for i in (1, 4, 7)}
    monkeypatch.setenv(TIMELINE_ENV, str(tmp_path))
    ahead = serve("--threads", "1", stops=stops)  # one thread of two cores: overlap is on
    for got, want in zip(ahead, plain):
        assert [(c.token_ids, c.finish_reason) for c in got] == \
            [(c.token_ids, c.finish_reason) for c in want]
    assert all(plain[1][i].finish_reason == "stop" for i in stops)
    files = {os.path.basename(p).split("-")[0]: load(p)[2]
             for p in glob.glob(str(tmp_path / "*.json"))}
    assert set(files) == {"frontend0", "scheduler0", "worker0"}
    worker, scheduler = by_step(files["worker0"]), by_step(files["scheduler0"])
    early = [s for s, (t, _) in worker["result_out"].items()
             if s + 1 in scheduler["plan_out"] and scheduler["plan_out"][s + 1][0] < t]
    assert early, "no plan was sent before the step ahead of it was back"
    assert any(name == "sse_out" for _, name, _, _ in files["frontend0"])


def test_served_tokens_are_the_same_with_multi_step_decoding():
    plain = serve("--no-overlap", "--decode-steps", "1")
    stops = {i: plain[0][i].token_ids[3] for i in (1, 4, 7)}
    metrics: dict[str, float] = {}
    multi = serve("--no-overlap", "--decode-steps", "4", stops=stops, metrics=metrics)
    for got, want in zip(multi, plain):
        assert [(c.token_ids, c.finish_reason) for c in got] == \
            [(c.token_ids, c.finish_reason) for c in want]
    assert all(plain[1][i].finish_reason == "stop" for i in stops)
    assert metrics["justapi:num_multi_step_plans_total"] > 0
