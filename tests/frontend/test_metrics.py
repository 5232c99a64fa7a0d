"""/metrics: Prometheus text that parses, counters that move with traffic, snapshot gauges."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from justapi.frontend.metrics import FrontendMetrics, MonotonicTotal
from justapi.wire.protocol import SchedulerStats
from tests.support.api_stack import MODEL, run, serving_stack, text_tokens, tokenizer


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples, name, **labels):
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return samples.get(key)


async def _scrape(stack):
    response = await stack.http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def test_every_sample_carries_the_model_name():
    async def scenario():
        async with serving_stack() as stack:
            await stack.wait_healthy()
            await stack.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            text = await _scrape(stack)
            families = list(text_string_to_metric_families(text))
            names = {f.name for f in families}
            for name in ("justapi:prompt_tokens", "justapi:generation_tokens",
                         "justapi:request_success", "justapi:time_to_first_token_seconds",
                         "justapi:inter_token_latency_seconds",
                         "justapi:e2e_request_latency_seconds", "justapi:num_requests_running",
                         "justapi:num_requests_waiting", "justapi:kv_cache_usage_perc",
                         "justapi:prefix_cache_queries", "justapi:prefix_cache_hits",
                         "justapi:num_preemptions", "prefix_cache_hits", "prefix_cache_misses",
                         "prefix_cache_hit_ratio", "prefix_cache_blocks",
                         "justapi:worker_num_requests_running",
                         "justapi:worker_kv_cache_usage_perc", "justapi:worker_healthy",
                         "justapi:scheduler_healthy"):
                assert name in names, name
            for family in families:
                for sample in family.samples:
                    assert sample.labels.get("model_name") == MODEL, sample
    run(scenario)


def test_counters_and_histograms_move_with_requests():
    async def scenario():
        async with serving_stack(tokens_per_step=2) as stack:
            before = _samples(await _scrape(stack))
            assert _value(before, "justapi:generation_tokens_total") == 0
            r1 = (await stack.http.post("/v1/completions", json={
                "prompt": "hello there", "max_tokens": 5})).json()
            r2 = (await stack.http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
                "stream": True})).content
            assert b"[DONE]" in r2
            after = _samples(await _scrape(stack))
            num_chat_prompt = stack.fake.submitted[1].prompt_token_ids.size
            assert _value(after, "justapi:prompt_tokens_total") == \
                r1["usage"]["prompt_tokens"] + num_chat_prompt
            assert _value(after, "justapi:generation_tokens_total") == 5 + len(text_tokens(0)) + 1
            assert _value(after, "justapi:request_success_total", finished_reason="length") == 1
            assert _value(after, "justapi:request_success_total", finished_reason="stop") == 1
            assert _value(after, "justapi:time_to_first_token_seconds_count") == 2
            assert _value(after, "justapi:e2e_request_latency_seconds_count") == 2
            # one inter-token gap per token after each request's first
            assert _value(after, "justapi:inter_token_latency_seconds_count") == \
                (5 - 1) + len(text_tokens(0))
            assert _value(after, "justapi:e2e_request_latency_seconds_sum") > 0
    run(scenario)


def test_aborted_and_stopped_requests_are_counted_by_reason():
    async def scenario():
        async with serving_stack() as stack:
            await stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 50, "stop": "brown"})
            samples = _samples(await _scrape(stack))
            assert _value(samples, "justapi:request_success_total", finished_reason="stop") == 1
    run(scenario)


def test_gauges_and_cache_counters_come_from_the_scheduler_snapshot():
    prompt = " ".join(["word"] * 40)

    async def scenario():
        async with serving_stack() as stack:
            for _ in range(2):
                await stack.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            num_prompt = len(tokenizer().encode(prompt))
            stack.fake.extra_stats = {"num_requests_waiting": 7, "num_preemptions": 3,
                                      "worker_0_num_steps": 12, "worker_0_num_scheduled_tokens": 345}
            await stack.next_snapshot()
            samples = _samples(await _scrape(stack))
            assert _value(samples, "justapi:num_requests_waiting") == 7
            assert _value(samples, "justapi:num_preemptions_total") == 3
            hits = (num_prompt - 1) // 16
            assert _value(samples, "prefix_cache_hits_total") == hits
            assert _value(samples, "prefix_cache_misses_total") == 2 * (num_prompt // 16) - hits
            assert _value(samples, "justapi:prefix_cache_queries_total") == 2 * num_prompt
            assert _value(samples, "justapi:prefix_cache_hits_total") == hits * 16
            assert 0 < _value(samples, "prefix_cache_hit_ratio") < 1
            assert _value(samples, "justapi:worker_num_requests_running", worker_id="0") == 0
            assert _value(samples, "justapi:worker_kv_cache_usage_perc", worker_id="0") == 0
            assert _value(samples, "justapi:worker_healthy", worker_id="0") == 1
            assert _value(samples, "justapi:worker_steps_total", worker_id="0") == 12
            assert _value(samples, "justapi:worker_scheduled_tokens_total", worker_id="0") == 345
            assert _value(samples, "justapi:kv_cache_usage_perc") == 0
            assert _value(samples, "justapi:scheduler_healthy") == 1
    run(scenario)


def test_scheduler_totals_stay_monotonic_across_a_restart():
    total = MonotonicTotal()
    assert [total.update(v) for v in (0, 5, 9, 2, 4, 4, 10)] == [0, 5, 9, 11, 13, 13, 19]


def test_snapshot_counters_survive_a_scheduler_restart():
    snapshots = [SchedulerStats(0.0, True, {"num_preemptions": n, "prefix_cache_hits": n}, [])
                 for n in (4, 6, 1)]
    current = {"stats": snapshots[0]}
    metrics = FrontendMetrics("m", lambda: current["stats"])
    seen = []
    for snapshot in snapshots:
        current["stats"] = snapshot
        samples = _samples(metrics.render().decode())
        seen.append(samples[("justapi:num_preemptions_total", (("model_name", "m"),))])
    assert seen == [4, 6, 7]


def test_no_snapshot_yet_exports_request_metrics_only():
    metrics = FrontendMetrics("m")
    timer = metrics.start_request(num_prompt_tokens=3, arrival_s=0.0)
    timer.on_tokens(2, now_s=1.0)
    timer.on_tokens(3, now_s=1.6)
    timer.on_finish("length", now_s=2.0)
    samples = _samples(metrics.render().decode())
    label = (("model_name", "m"),)
    assert samples[("justapi:prompt_tokens_total", label)] == 3
    assert samples[("justapi:generation_tokens_total", label)] == 5
    assert samples[("justapi:time_to_first_token_seconds_sum", label)] == 1.0
    assert samples[("justapi:inter_token_latency_seconds_count", label)] == 4
    assert abs(samples[("justapi:inter_token_latency_seconds_sum", label)] - 0.6) < 1e-9
    assert samples[("justapi:e2e_request_latency_seconds_sum", label)] == 2.0
    assert samples[("justapi:scheduler_healthy", label)] == 0
    assert ("justapi:num_requests_running", label) not in samples


def test_request_failures_by_stage_from_both_processes():
    """The scheduler's stages from its snapshots (monotonic across its restart), the
    frontend's detokenize from its own count: one family, labelled by stage."""
    snapshots = [SchedulerStats(0.0, True, {"request_failures_admit": a, "request_failures_plan": p,
                                            "request_failures_mask": 0,
                                            "request_failures_results": 1}, [])
                 for a, p in ((1, 2), (3, 2), (0, 1))]
    current = {"stats": snapshots[0]}
    metrics = FrontendMetrics("m", lambda: current["stats"])
    timer = metrics.start_request(4)
    timer.on_failure("detokenize")
    seen = []
    for snapshot in snapshots:
        current["stats"] = snapshot
        samples = _samples(metrics.render().decode())
        seen.append({stage: samples[("justapi:request_failures_total",
                                     (("model_name", "m"), ("stage", stage)))]
                     for stage in ("admit", "plan", "mask", "results", "detokenize")})
    assert seen[0] == {"admit": 1, "plan": 2, "mask": 0, "results": 1, "detokenize": 1}
    assert seen[2] == {"admit": 3, "plan": 3, "mask": 0, "results": 1, "detokenize": 1}
