"""Which kernel a matmul of M rows takes under `--weights auto` (CPU): a plan measured on this
machine at start-up, per weight type and shape, cached per CPU like the kernel builds.

Paths over one BlockMatrix (block_linear.py runs them):
  int8        block kernel, activations rounded to 8 bits per 32 values, integer dot products
  int8_panels the same arithmetic with x's rows in panels of 8, one int32 lane each: a group's
              float work once per 8 rows (steps of many rows)
  dense       a tile of the matrix expanded to fp32 in a scratch buffer, dense GEMM (MKL)
  dense_bf16  the same in bf16: a candidate only where the CPU multiplies bf16 in hardware
Each path's time is modelled as a + b * rows (a: what a call costs whatever its rows, such as
decoding the weights or expanding a tile; b: the work per row), fitted by least squares (on
relative residuals) to the fastest of a few rounds at several row counts; a step of M rows
takes the path whose line is lowest at M, or a simpler one within TIE_MARGIN of it. Lines
cross at most once pairwise, so a plan is a few ranges, and one noisy time (the machine is
shared) moves a crossover a little instead of flipping a range. A fresh plan is timed again
where it matters before anything keeps it, and a kept plan is checked at every start
(settle_plan): no checked count takes a path more than SLOWER_LIMIT slower than the best timed
in the same check. `fit_line`, `plan_from_timings`, `losing_counts`, `patch_plan` and
`PathPlan.path_for` are pure; the timings take the candidates in turns (one call of each per
round), so other processes' load falls on all of them alike, and keep each one's fastest round.
Owns: the choice rule and the measurement. Does not own: the kernels, the cache file
(plan_cache.py).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

PATHS = ("int8", "int8_panels", "dense", "dense_bf16")
INT8_FAMILY = ("int8", "int8_panels")
"""Paths that give a row the same bits at every row count (the same integer sums and scaling)."""
MEASURE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
"""Row counts timed at start-up: decode batches and speculative verification sit among them,
and 512 for prefill chunks: the dense GEMM gains per row up to there (SmolLM2's gate/up:
0.038 ms a row at 128, 0.027 at 512), so lines fitted to 128 rows at most kept int8 for
prefill, 1.4x slower than the dense tile at 512."""
DROP_RATIO = 2.0
LONG_CALL_S = 0.05
"""A count whose slowest call at the previous count took longer is timed over 2 rounds, not
`repeats`: a 7B model's matrices (11008 x 4096) take 0.1-1 s a call at 128-512 rows, where
the noise of one round matters less than the start-up time of five."""
MEASURE_BUDGET_S = 4.0
"""Seconds one matrix's measurement may spend before it stops adding row counts (never before
CHECK_ROWS): a count is timed only where the time so far plus its predicted time (the last
count's, scaled by rows) stays within this. Gemma 3's 262144 x 640 head took 26 of a fresh
start's 31 s timing every path up to 512 rows (Zen 4, 2 threads), and a head's steps are its
logit rows (a decode batch, a chunk's last row), not prefill chunks; past the last count timed
each path's last segment goes on (plan_from_timings)."""
TIE_MARGIN = 0.05
"""Paths within this share of the fastest are a near tie: the simpler one (earlier in PATHS)
takes the rows. Noise of a few percent then moves no range, and the plan keeps fewer paths."""
SLOWER_LIMIT = 1.10
"""A plan's choice at a checked row count may take at most this times the best path's time
measured in the same check; more, and the plan is measured again (or patched there)."""
CHECK_ROWS = (1, 16)
"""Where every start checks a cached plan: a decode step of one sequence and of sixteen."""
CHECK_REPEATS = 3


@dataclass(frozen=True)
class PathPlan:
    """((most rows, path), ...) by ascending rows; the last entry covers every larger count."""

    steps: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a path plan needs at least one step")
        bounds = [rows for rows, _ in self.steps]
        if bounds != sorted(set(bounds)) or bounds[0] < 1:
            raise ValueError(f"plan row bounds must rise from >= 1, got {bounds}")
        unknown = {path for _, path in self.steps} - set(PATHS)
        if unknown:
            raise ValueError(f"unknown weight paths {sorted(unknown)} (known: {', '.join(PATHS)})")

    def path_for(self, rows: int) -> str:
        for most_rows, path in self.steps:
            if rows <= most_rows:
                return path
        return self.steps[-1][1]

    @classmethod
    def only(cls, path: str) -> PathPlan:
        return cls(((1, path),))

    def describe(self) -> str:
        """e.g. 'int8 <= 16 rows < dense'."""
        parts = [f"{path} <= {rows}" for rows, path in self.steps[:-1]]
        return " rows < ".join(parts + [self.steps[-1][1]]) if parts else f"{self.steps[-1][1]} always"


def fit_line(rows: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(a, b) of seconds ~ a + b * rows, least squares on relative residuals (weights 1 / s^2:
    a 1-row call of 0.1 ms counts as much as a 64-row call of 20 ms), with a, b >= 0."""
    w = [1.0 / max(s, 1e-12) ** 2 for s in seconds]
    total = sum(w)
    mean_r = sum(wi * r for wi, r in zip(w, rows)) / total
    mean_s = sum(wi * s for wi, s in zip(w, seconds)) / total
    spread = sum(wi * (r - mean_r) ** 2 for wi, r in zip(w, rows))
    b = sum(wi * (r - mean_r) * (s - mean_s) for wi, r, s in zip(w, rows, seconds)) / spread if spread else 0.0
    b = max(b, 0.0)
    return max(mean_s - b * mean_r, 0.0), b


def plan_from_timings(rows: Sequence[int], seconds: Mapping[str, Sequence[float]],
                      max_rows: int = 1 << 16) -> PathPlan:
    """The plan of the fitted lines (near ties: the simpler path, simplest_near_best): each path's range
    ends where another's line drops below it, found at every crossing up to `max_rows`; past
    the last count measured, each path's last segment extended. A path may have times for the
    first few counts only (measurement stopped timing it)."""
    if not seconds or any(not 0 < len(times) <= len(rows) for times in seconds.values()):
        raise ValueError("every path needs one time per measured row count (or per leading ones)")
    if list(rows) != sorted(set(rows)) or rows[0] < 1:
        raise ValueError(f"measured row counts must rise from >= 1, got {list(rows)}")
    lines = {path: fit_line(rows[:len(times)], times) for path, times in seconds.items()}
    # A path measurement stopped timing was far behind where it stopped: its line, fitted to a
    # few small counts, is not extrapolated past them (a 1-4-row fit of the fp32 block kernel
    # came out flat and took the head's prefill steps, 5x slower than the int8 panels there).
    reach = {path: max_rows if len(times) == len(rows) else rows[len(times) - 1] for path, times in seconds.items()}
    # Past the last count measured, each path goes on from its last time at the slope of its
    # last segment: a line fitted over every count follows the small ones (relative weights),
    # where a dense GEMM pays its fixed cost, and missed that past 512 rows it gains on the int8
    # panels (on an AVX2 Zen 3 the panels took every prefill chunk, 5-20% slower at 2048 rows).
    last = rows[-1]
    tails = {path: (times[-1], max(0.0, (times[-1] - times[-2]) / (rows[-1] - rows[-2])))
             for path, times in seconds.items() if len(times) == len(rows) >= 2}

    def cost(path: str, count: int) -> float:
        if count > last and path in tails:
            at_last, slope = tails[path]
            return at_last + slope * (count - last)
        return lines[path][0] + lines[path][1] * count

    def best(count: int) -> str:
        eligible = [path for path in lines if count <= reach[path]] or list(lines)
        return simplest_near_best({path: cost(path, count) for path in eligible})

    # the ranges break where a path's reach ends and where the cost model changes (past last)
    ends = {c for r in reach.values() for c in (r, r + 1)} | {last, last + 1}
    beyond = {c for c in _crossings([(t - s * last, s) for t, s in tails.values()]) if c > last}
    inside = _crossings(list(lines.values()))
    counts = sorted({1, max_rows} | {c for c in inside | ends | beyond if 1 <= c < max_rows})
    steps: list[tuple[int, str]] = []
    for count in counts:  # the winner is constant between consecutive crossings
        path = best(count)
        if steps and steps[-1][1] == path:
            steps[-1] = (count, path)
        else:
            steps.append((count, path))
    return PathPlan(tuple(steps))


def simplest_near_best(seconds: Mapping[str, float]) -> str:
    """The simplest path (earliest in PATHS) whose time is within TIE_MARGIN of the fastest."""
    low = min(seconds.values())
    near = [path for path, t in seconds.items() if t <= (1 + TIE_MARGIN) * low]
    return min(near, key=lambda path: PATHS.index(path) if path in PATHS else len(PATHS))


def _crossings(lines: list[tuple[float, float]]) -> set[int]:
    """Row counts just below and at each pairwise crossing of the lines, and of each line with
    another scaled by 1 + TIE_MARGIN (where a near tie begins or ends)."""
    out: set[int] = set()
    scale = 1 + TIE_MARGIN
    for i, (a1, b1) in enumerate(lines):
        for a2, b2 in lines[i + 1:]:
            for (c1, d1), (c2, d2) in (((a1, b1), (a2, b2)), ((a1 * scale, b1 * scale), (a2, b2)),
                                       ((a1, b1), (a2 * scale, b2 * scale))):
                if d1 != d2:
                    at = (c2 - c1) / (d1 - d2)
                    if 0 <= at < 1 << 30:
                        out |= {int(at), int(at) + 1}
    return out


def paired_times(calls: Mapping[str, Callable[[], object]], repeats: int,
                 timer: Callable[[], float] = time.perf_counter,
                 reduce: Callable[[list[float]], float] = min) -> dict[str, float]:
    """Seconds of each call, timed in turns after one untimed round, reduced over the repeats:
    by default the minimum, the estimate other processes cannot raise (a burst of load while
    one path was timed made the median pick a path 2x slower for a whole shape, cached)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {path: [] for path in calls}
    for _ in range(repeats):
        for path, call in calls.items():
            start = timer()
            call()
            times[path].append(timer() - start)
    return {path: reduce(t) for path, t in times.items()}


def measure_plan(run: Callable[[str, torch.Tensor], object], in_features: int, paths: Sequence[str],
                 rows: Sequence[int] = MEASURE_ROWS, repeats: int = 5,
                 timer: Callable[[], float] = time.perf_counter,
                 budget_s: float = MEASURE_BUDGET_S) -> tuple[PathPlan, dict]:
    """Time `run(path, x)` for x of each row count on every path -> (plan, {path: seconds}).
    A path DROP_RATIO times slower than the best at two counts in a row, and not catching up,
    is not timed at larger counts (its line is fitted to what was measured): a 150k-token head
    at 128 rows on a slow path would cost seconds of start-up to learn what the first counts
    already say. Counts after a long call take 2 rounds (LONG_CALL_S). Counts past CHECK_ROWS
    stop where the next would overrun `budget_s` (MEASURE_BUDGET_S): the counts timed are the
    first len(the longest list of seconds) of `rows`."""
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    active = list(paths)
    generator = torch.Generator().manual_seed(0)
    rounds, began, last_s = repeats, timer(), 0.0
    with torch.inference_mode():
        for i, count in enumerate(rows):
            if count > max(CHECK_ROWS) and i and timer() - began + last_s * count / rows[i - 1] > budget_s:
                break
            start = timer()
            x = torch.randn(count, in_features, generator=generator)
            best = paired_times({path: functools.partial(run, path, x) for path in active}, rounds, timer)
            for path in active:
                seconds[path].append(best[path])
            active = [path for path in active if not _far_behind(seconds, path)]
            rounds = min(repeats, 2) if max(best.values()) > LONG_CALL_S else repeats
            last_s = timer() - start
    return plan_from_timings(rows[:timed_counts(seconds)], seconds), seconds


def timed_counts(seconds: Mapping[str, Sequence[float]]) -> int:
    """How many of the row counts a measurement timed (its longest list of seconds)."""
    return max(len(times) for times in seconds.values())


def _far_behind(seconds: Mapping[str, Sequence[float]], path: str) -> bool:
    """`path` took DROP_RATIO times the best time at each of the last two counts, and its time
    grew at least as much as the best path's over the last count: a path still catching up is
    kept. The int8 panels compute 8 rows as cheaply as 1 and the dense tile pays its expansion
    once per call, so at 1-4 rows of a 4096-wide matrix both were 2x behind the per-row int8
    kernel and were dropped, and a 7B model's 512-row prefill chunks went to the fp32 block
    kernel instead of the panels."""
    times = seconds[path]
    n = len(times)
    if n < 3:
        return False
    for back in (1, 2):
        best = min(t[n - back] for t in seconds.values() if len(t) >= n)
        if times[-back] < DROP_RATIO * best:
            return False
    leader = min((t for t in seconds.values() if len(t) >= n), key=lambda t: t[n - 1])
    return times[-1] - times[-2] >= leader[n - 1] - leader[n - 2]


class PathTimer:
    """Times one matrix's candidate paths: `run(path, x)` for x of `in_features` columns, every
    path in turns (paired_times), on `timer` (a fake clock in tests)."""

    def __init__(self, run: Callable[[str, torch.Tensor], object], in_features: int, paths: Sequence[str],
                 timer: Callable[[], float] = time.perf_counter, rows: Sequence[int] = MEASURE_ROWS,
                 budget_s: float = MEASURE_BUDGET_S) -> None:
        self.run, self.in_features, self.paths, self.timer = run, in_features, tuple(paths), timer
        self.rows = tuple(rows)
        """The row counts a measurement may time (measure_plan; budget_s may stop it earlier)."""
        self.budget_s = budget_s

    def measure(self) -> tuple[PathPlan, dict[str, list[float]]]:
        return measure_plan(self.run, self.in_features, self.paths, self.rows, timer=self.timer,
                            budget_s=self.budget_s)

    def at(self, counts: Sequence[int], repeats: int = CHECK_REPEATS) -> dict[int, dict[str, float]]:
        """{count: {path: fastest of `repeats` rounds}} for every candidate path."""
        generator = torch.Generator().manual_seed(1)
        out = {}
        with torch.inference_mode():
            for count in counts:
                x = torch.randn(count, self.in_features, generator=generator)
                calls = {path: functools.partial(self.run, path, x) for path in self.paths}
                out[count] = paired_times(calls, repeats, self.timer)
        return out


def losing_counts(plan: PathPlan, times: Mapping[int, Mapping[str, float]],
                  limit: float = SLOWER_LIMIT) -> list[int]:
    """The counts at which the plan's path took more than `limit` times the fastest path timed
    in the same check (or was not timed at all: a path this CPU no longer offers)."""
    out = []
    for count, seconds in sorted(times.items()):
        chosen = seconds.get(plan.path_for(count))
        if chosen is None or chosen > limit * min(seconds.values()):
            out.append(count)
    return out


def patch_plan(plan: PathPlan, times: Mapping[int, Mapping[str, float]], limit: float = SLOWER_LIMIT) -> PathPlan:
    """The plan with each losing count (losing_counts) given the path that won there (near ties:
    the simpler one): a count the fitted lines misjudge (8 rows on the int8 panels cost what
    7 do, which no line says) takes what was measured there."""
    fixes = {count: simplest_near_best(times[count]) for count in losing_counts(plan, times, limit)}
    if not fixes:
        return plan
    last_bound = plan.steps[-1][0]
    points = {rows for rows, _ in plan.steps} | {1} | {c for count in fixes for c in (count - 1, count) if c >= 1}
    if max(fixes) >= last_bound:
        points.add(max(fixes) + 1)  # larger counts keep the plan's last path
    steps: list[tuple[int, str]] = []
    for point in sorted(points):
        path = fixes.get(point, plan.path_for(point))
        if steps and steps[-1][1] == path:
            steps[-1] = (point, path)
        else:
            steps.append((point, path))
    return PathPlan(tuple(steps))


def confirm_counts(plan: PathPlan, most: int = MEASURE_ROWS[-1]) -> list[int]:
    """Where a fresh plan is timed again before it is kept: CHECK_ROWS and both sides of each
    boundary between its ranges, up to `most` rows."""
    bounds = {c for rows, _ in plan.steps[:-1] for c in (rows, rows + 1)}
    return sorted(c for c in set(CHECK_ROWS) | bounds if c <= most)


@dataclass(frozen=True)
class Settled:
    """What a start does with one matrix's plan: `how` is "checked" (the cached plan won its
    check), "measured" (nothing cached) or "replaced" (the cached plan lost its check);
    `check` holds the last check's times."""

    plan: PathPlan
    how: str
    check: dict[int, dict[str, float]]


def settle_plan(cached: PathPlan | None, timer: PathTimer) -> Settled:
    """The plan to serve with. A cached plan is timed against every path at CHECK_ROWS and kept
    if it is within SLOWER_LIMIT of the best at each; otherwise (or with none) the paths are
    measured (in turns, each path's fastest round) and the new plan timed again at
    confirm_counts. Where that confirmation finds a count it loses, everything is measured a
    second time, each time taken as the faster of the two passes, the lines fitted again and
    any count still losing patched (patch_plan): no count checked takes a path more than
    SLOWER_LIMIT slower than the best measured there."""
    if cached is not None:
        check = timer.at(CHECK_ROWS)
        if not losing_counts(cached, check):
            return Settled(cached, "checked", check)
    how = "measured" if cached is None else "replaced"
    plan, seconds = timer.measure()
    most = timer.rows[timed_counts(seconds) - 1]
    check = timer.at(confirm_counts(plan, most))
    if not losing_counts(plan, check):
        return Settled(plan, how, check)
    _, again = timer.measure()
    merged = {path: [min(a, b) for a, b in zip(seconds[path], again[path])] + seconds[path][len(again[path]):]
              + again[path][len(seconds[path]):] for path in seconds}
    counts = timed_counts(merged)
    plan = plan_from_timings(timer.rows[:counts], merged)
    recheck = timer.at(sorted(set(confirm_counts(plan, timer.rows[counts - 1])) | set(check)))
    for count, times in check.items():  # the faster of the two checks, per path
        recheck[count] = {path: min(t, times.get(path, t)) for path, t in recheck[count].items()}
    return Settled(patch_plan(plan, recheck), how, recheck)
