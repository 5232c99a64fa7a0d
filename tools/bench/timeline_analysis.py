"""Where a served step's time goes, from the three processes' timelines (justapi/ops/timeline.py).

Lines up the worker's, the scheduler's and the frontend's events of each step by step id on
the one monotonic clock and splits the worker's step period (plan in -> next plan in) into its
busy part (prepare, forward, sample, send) and its idle wait for the next plan, which is
itself split into the result's trip to the scheduler, the scheduler, and the plan's trip back
(with overlap the plan is already waiting: the wait is only its receipt). The frontend's part
(deltas to the frontend, deltas to SSE text) runs beside the worker's next step; each
process's CPU time per step says what it takes from the worker's cores. A multi-step plan
(--decode-steps) counts as its k steps: its period, its parts outside the forward and sampling,
and the CPU times are divided by k (per token of a stream), its forward and sampling are its
first step's.
Owns: that arithmetic. Does not own: the runs (timeline.py) or the events (the processes).
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from justapi.ops.timeline import Event

NS_PER_MS = 1e6


def by_step(events: list[Event]) -> dict[str, dict[int, tuple[int, int]]]:
    """event name -> step id -> (first time ns, count) (the first mark of a step wins)."""
    out: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
    for t_ns, name, step_id, count in events:
        out[name].setdefault(step_id, (t_ns, count))
    return out


@dataclass
class Breakdown:
    """Medians in ms over the steps that qualified (full-batch decode steps)."""

    num_steps: int = 0
    parts: dict[str, float] = field(default_factory=dict)
    plan_waiting: float = 0.0  # share of steps whose plan reached the worker before it was free
    steps_per_plan: float = 1.0  # median steps a plan ran (multi-step decoding)

    def get(self, name: str) -> float:
        return self.parts.get(name, float("nan"))


def _median_ms(values: Sequence[float]) -> float:
    return statistics.median(values) / NS_PER_MS if values else float("nan")


def served_breakdown(worker: list[Event], scheduler: list[Event], frontend: list[Event],
                     batch: int) -> Breakdown:
    """Split each full-batch decode step of one worker and the gap to its next step."""
    w, s, f = by_step(worker), by_step(scheduler), by_step(frontend)
    last_sample = {step: t for t, name, step, _ in worker if name == "sample_end"}  # the last
    steps_of = Counter(step for _, name, step, _ in worker if name == "forward_start")
    plans = sorted((t, step) for step, (t, _) in w["plan_in"].items())
    parts: dict[str, list[float]] = defaultdict(list)
    waiting = 0
    for (t_in, step), (t_next, nxt) in zip(plans, plans[1:]):
        if not _is_decode(w, step, batch) or step not in w["result_out"] \
                or step not in w["sample_end"]:
            continue
        k = steps_of[step]
        t_fwd, t_end = w["forward_start"][step][0], w["forward_end"][step][0]
        t_sample, t_out = w["sample_end"][step][0], w["result_out"][step][0]
        parts["steps"].append(k)
        parts["period"].append((t_next - t_in) / k)
        parts["prepare"].append((t_fwd - t_in) / k)
        parts["forward"].append(t_end - t_fwd)
        parts["sample"].append(t_sample - t_end)
        parts["send"].append((t_out - last_sample[step]) / k)
        parts["idle"].append((t_next - t_out) / k)
        plan_out = s["plan_out"].get(nxt, (None, 0))[0]
        if plan_out is not None and plan_out <= t_out:
            waiting += 1
        elif plan_out is not None and step in s["result_in"]:
            parts["to_scheduler"].append((s["result_in"][step][0] - t_out) / k)
            parts["scheduler"].append((plan_out - s["result_in"][step][0]) / k)
            parts["to_worker"].append((t_next - plan_out) / k)
        if step in s["result_in"] and step in s["deltas_out"]:
            parts["update"].append((s["deltas_out"][step][0] - s["result_in"][step][0]) / k)
        if step in s["deltas_out"] and step in f["deltas_in"]:
            parts["to_frontend"].append((f["deltas_in"][step][0] - s["deltas_out"][step][0]) / k)
        for name, table in (("cpu_worker", w), ("cpu_scheduler", s), ("cpu_frontend", f)):
            if step in table["cpu"] and nxt in table["cpu"]:  # CPU time between two steps
                parts[name].append((table["cpu"][nxt][1] - table["cpu"][step][1]) / k)
    _frontend_parts(frontend, parts)
    num = len(parts["period"])
    steps = statistics.median(parts.pop("steps")) if num else 1.0
    return Breakdown(num, {k: _median_ms(v) for k, v in parts.items()}, waiting / num if num else 0.0,
                     steps)


def _is_decode(w: dict[str, dict[int, tuple[int, int]]], step: int, batch: int) -> bool:
    """A step of `batch` sequences, one token each (forward_start counts the sequences,
    forward_end the tokens)."""
    return (step in w["forward_start"] and step in w["forward_end"]
            and w["forward_start"][step][1] == batch and w["forward_end"][step][1] == batch)


def _frontend_parts(frontend: list[Event], parts: dict[str, list[float]]) -> None:
    """deltas_in -> each sse_out after it (before the next deltas_in): the frontend's turn."""
    last_in = None
    for t_ns, name, _, _ in frontend:
        if name == "deltas_in":
            last_in = t_ns
        elif name == "sse_out" and last_in is not None:
            parts["frontend"].append(t_ns - last_in)


def offline_breakdown(runner: list[Event], batch: int) -> Breakdown:
    """The in-process engine's full-batch decode steps: period (forward_start to the next),
    forward and sample."""
    r = by_step(runner)
    starts = sorted((t, step) for step, (t, _) in r["forward_start"].items())
    parts: dict[str, list[int]] = defaultdict(list)
    for (t_fwd, step), (t_next, _) in zip(starts, starts[1:]):
        if not _is_decode(r, step, batch) or step not in r["sample_end"]:
            continue
        parts["period"].append(t_next - t_fwd)
        parts["forward"].append(r["forward_end"][step][0] - t_fwd)
        parts["sample"].append(r["sample_end"][step][0] - r["forward_end"][step][0])
    num = len(parts["period"])
    return Breakdown(num, {k: _median_ms(v) for k, v in parts.items()})
