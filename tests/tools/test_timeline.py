"""Per-step timelines: the ring (justapi/ops/timeline.py) is off without JUSTAPI_TIMELINE,
bounded, and round-trips through its file; the analysis (tools/bench/timeline_analysis.py)
splits hand-made steps into exactly the parts they were built from."""
from __future__ import annotations

import argparse
import contextlib
import os

import pytest

from justapi.model.gguf_file import resolve_model_path
from justapi.ops.timeline import TIMELINE_ENV, Timeline, load
from tools.bench import timeline
from tools.bench.timeline_analysis import offline_breakdown, served_breakdown

MS = 1_000_000


def test_off_by_default_bounded_when_on_and_dumped(tmp_path, monkeypatch):
    monkeypatch.delenv(TIMELINE_ENV, raising=False)
    off = Timeline.from_env("worker", 3)
    off.mark("plan_in", 1)
    off.mark_cpu(1)
    assert not off.events and off.dump() is None
    monkeypatch.setenv(TIMELINE_ENV, str(tmp_path / "t"))
    on = Timeline.from_env("worker", 3)
    on.events = type(on.events)(maxlen=4)
    for step in range(6):
        on.mark("plan_in", step, 2)
    on.mark_cpu(6)
    path = on.dump()
    assert path == str(tmp_path / "t" / f"worker3-{os.getpid()}.json")
    role, index, events = load(path)
    assert (role, index) == ("worker", 3) and len(events) == 4  # the newest four
    assert [e[2] for e in events] == [3, 4, 5, 6] and events[-1][1] == "cpu"
    assert events[-1][3] > 0 and all(a[0] <= b[0] for a, b in zip(events, events[1:]))


def worker_step(step: int, t: int, batch: int, forward: int = 30) -> list[tuple[int, str, int, int]]:
    """One worker step starting at t ms: prepare 1, forward, sample 2, send 1 (ms)."""
    return [(t * MS, "cpu", step, 10 * step * MS), (t * MS, "plan_in", step, batch),
            ((t + 1) * MS, "forward_start", step, batch),
            ((t + 1 + forward) * MS, "forward_end", step, batch),
            ((t + 3 + forward) * MS, "sample_end", step, -1),
            ((t + 4 + forward) * MS, "result_out", step, 0)]


def test_a_served_step_is_split_into_its_parts():
    """Steps of 34 ms busy; the next plan leaves the scheduler 2 ms after the result arrives
    1 ms after it was sent, and reaches the worker 3 ms later: 6 ms idle, period 40 ms."""
    worker, scheduler, frontend = [], [], []
    for step in range(1, 6):
        t = 40 * (step - 1)
        worker += worker_step(step, t, batch=4)
        scheduler += [((t + 35) * MS, "result_in", step, 0),
                      ((t + 35) * MS, "cpu", step, 2 * step * MS),
                      ((t + 36) * MS, "deltas_out", step, 0),
                      ((t + 37) * MS, "plan_out", step + 1, 0)]
        frontend += [((t + 38) * MS, "deltas_in", step, 4),
                     ((t + 39) * MS, "sse_out", -1, 1)]
    parts = served_breakdown(sorted(worker), sorted(scheduler), sorted(frontend), batch=4)
    assert parts.num_steps == 4 and parts.plan_waiting == 0.0
    expected = {"period": 40, "prepare": 1, "forward": 30, "sample": 2, "send": 1, "idle": 6,
                "to_scheduler": 1, "scheduler": 2, "to_worker": 3, "update": 1,
                "to_frontend": 2, "frontend": 1, "cpu_worker": 10, "cpu_scheduler": 2}
    assert {k: parts.get(k) for k in expected} == pytest.approx(expected)
    assert served_breakdown(worker, scheduler, frontend, batch=8).num_steps == 0  # not full


def test_a_multi_step_plan_counts_as_its_steps():
    """Plans of 3 steps (forward 30, sample 2 each) after a 1 ms prepare, sent 1 ms after the
    last sampling, the next plan 6 ms later: per step, period 104 / 3 and idle 2."""
    worker = []
    for plan in range(1, 5):
        t = 104 * (plan - 1)
        worker += [(t * MS, "cpu", plan, 30 * plan * MS), (t * MS, "plan_in", plan, 1)]
        for j in range(3):
            start = t + 1 + 32 * j
            worker += [(start * MS, "forward_start", plan, 1),
                       ((start + 30) * MS, "forward_end", plan, 1),
                       ((start + 32) * MS, "sample_end", plan, -1)]
        worker.append(((t + 98) * MS, "result_out", plan, 0))
    parts = served_breakdown(sorted(worker), [], [], batch=1)
    assert parts.num_steps == 3 and parts.steps_per_plan == 3
    expected = {"period": 104 / 3, "prepare": 1 / 3, "forward": 30, "sample": 2, "send": 1 / 3,
                "idle": 2, "cpu_worker": 10}
    assert {k: parts.get(k) for k in expected} == pytest.approx(expected)


def test_a_plan_sent_before_the_result_counts_as_waiting():
    worker, scheduler = [], []
    for step in range(1, 5):
        t = 35 * (step - 1)
        worker += worker_step(step, t, batch=1)
        scheduler.append(((t + 10) * MS, "plan_out", step + 1, 0))  # while `step` runs
    parts = served_breakdown(sorted(worker), scheduler, [], batch=1)
    assert parts.plan_waiting == 1.0 and parts.get("idle") == pytest.approx(1.0)
    assert parts.get("period") == pytest.approx(35.0)


def test_offline_steps():
    runner = [e for step in range(1, 5) for e in worker_step(step, 33 * (step - 1), batch=2)]
    parts = offline_breakdown(runner, batch=2)
    assert parts.num_steps == 3
    assert (parts.get("period"), parts.get("forward"), parts.get("sample")) == \
        pytest.approx((33.0, 30.0, 2.0))


@pytest.mark.parametrize("model", ["", "tiny-vocabulary.gguf"])
def test_the_served_prompts_are_sized_in_the_models_own_tokens_as_the_offline_ones(tmp_path, monkeypatch, model):
    """A prompt sized by words was 4.3x longer in a 384-token vocabulary's tokens than the offline
    engine's (the ~1B shape read 0.58 of offline at one stream; 0.96 sized in its own tokens)."""
    if model:
        model = str(tmp_path / model)
        open(model, "wb").close()
    sent = []

    @contextlib.contextmanager
    def pool(*flags):
        yield argparse.Namespace(base_url="http://127.0.0.1:1")

    monkeypatch.setattr(timeline, "ServedPool", pool)
    monkeypatch.setattr(timeline, "run_bench",
                        lambda url, bench: sent.append(bench) or {"summary": {"output_throughput": 1.0}})
    monkeypatch.setattr(timeline, "served_breakdown", lambda *parts: "step")
    args = argparse.Namespace(model=model, weights="auto", rounds=2, max_tokens=8, prompt_tokens=100)
    assert timeline.served(args, 4, []) == timeline.Run(1.0, "step")
    bench = sent[0]
    assert bench[bench.index("--tokenizer-gguf") + 1] == resolve_model_path(model)
    assert bench[bench.index("--prompt-tokens") + 1] == "100" and bench[bench.index("--num-requests") + 1] == "8"
