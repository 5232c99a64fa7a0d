"""Where a served step's time goes, from the three processes' timelines (justapi/ops/timeline.py).

Lines up the worker's, the scheduler's and the frontend's events of each step by step id on
the one monotonic clock and splits the worker's step period (plan in -> next plan in) into its
busy part (prepare, forward, sample, send) and its idle wait for the next plan, which is
itself split into the result's trip to the scheduler, the scheduler, and the plan's trip back
(with overlap the plan is already waiting: the wait is only its receipt). The frontend's part
(deltas to the frontend, deltas to SSE text) runs beside the worker's next step; each
process's CPU time per step says what it takes from the worker's cores.
Owns: that arithmetic. Does not own: the runs (timeline.py) or the events (the processes).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
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

    def get(self, name: str) -> float:
        return self.parts.get(name, float("nan"))


def _median_ms(values: list[int]) -> float:
    return statistics.median(values) / NS_PER_MS if values else float("nan")


def served_breakdown(worker: list[Event], scheduler: list[Event], frontend: list[Event],
                     batch: int) -> Breakdown:
    """Split each full-batch decode step of one worker and the gap to its next step."""
    w, s, f = by_step(worker), by_step(scheduler), by_step(frontend)
    plans = sorted((t, step) for step, (t, _) in w["plan_in"].items())
    parts: dict[str, list[int]] = defaultdict(list)
    waiting = 0
    for (t_in, step), (t_next, nxt) in zip(plans, plans[1:]):
        if not _is_decode(w, step, batch) or step not in w["result_out"] \
                or step not in w["sample_end"]:
            continue
        t_fwd, t_end = w["forward_start"][step][0], w["forward_end"][step][0]
        t_sample, t_out = w["sample_end"][step][0], w["result_out"][step][0]
        parts["period"].append(t_next - t_in)
        parts["prepare"].append(t_fwd - t_in)
        parts["forward"].append(t_end - t_fwd)
        parts["sample"].append(t_sample - t_end)
        parts["send"].append(t_out - t_sample)
        parts["idle"].append(t_next - t_out)
        plan_out = s["plan_out"].get(nxt, (None, 0))[0]
        if plan_out is not None and plan_out <= t_out:
            waiting += 1
        elif plan_out is not None and step in s["result_in"]:
            parts["to_scheduler"].append(s["result_in"][step][0] - t_out)
            parts["scheduler"].append(plan_out - s["result_in"][step][0])
            parts["to_worker"].append(t_next - plan_out)
        if step in s["result_in"] and step in s["deltas_out"]:
            parts["update"].append(s["deltas_out"][step][0] - s["result_in"][step][0])
        if step in s["deltas_out"] and step in f["deltas_in"]:
            parts["to_frontend"].append(f["deltas_in"][step][0] - s["deltas_out"][step][0])
        for name, table in (("cpu_worker", w), ("cpu_scheduler", s), ("cpu_frontend", f)):
            if step in table["cpu"] and nxt in table["cpu"]:  # CPU time between two steps
                parts[name].append(table["cpu"][nxt][1] - table["cpu"][step][1])
    _frontend_parts(frontend, parts)
    num = len(parts["period"])
    return Breakdown(num, {k: _median_ms(v) for k, v in parts.items()}, waiting / num if num else 0.0)


def _is_decode(w: dict[str, dict[int, tuple[int, int]]], step: int, batch: int) -> bool:
    """A step of `batch` sequences, one token each (forward_start counts the sequences,
    forward_end the tokens)."""
    return (step in w["forward_start"] and step in w["forward_end"]
            and w["forward_start"][step][1] == batch and w["forward_end"][step][1] == batch)


def _frontend_parts(frontend: list[Event], parts: dict[str, list[int]]) -> None:
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
