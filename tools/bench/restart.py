"""Scheduler restart figures of a real `justapi serve` pool: a streaming load, the scheduler
SIGKILLed mid-way, and how long until the first token of its successor reaches a client
(the clients' pause), whether every request still completed, and whether each output equals
the uninterrupted run's (greedy and seeded requests continue exactly). Prints one row per
load and a summary.

Two pools side by side, kills in turns: "standby" (the default: each kill waits for the
pool's scheduler started ahead; the column says whether one was there) and "cold"
(--no-standby-scheduler: the successor starts after the death). Per pool the first load runs
with no kill (the outputs every other load is compared with), the second also (the control:
how many outputs an uninterrupted rerun reproduces: with SmolLM2's default weight paths the
numerics of a step depend on the batch, so not always all; with --weights fp32 all). A kill comes once
every stream has had KILL_AFTER_EVENTS events; "resubmitted" is when the frontend resubmitted
the open requests to the successor (its log line), "first token" the first event a client
got after that (a token of the successor: the dead scheduler's had reached the clients by
then, a new one needs a prefill step).
--long-prompts makes every fourth prompt ~600 tokens (a restart re-chunks those: under the
default a row's last bits may then differ; --batch-invariant passes the pools that flag).
Usage: python -m tools.bench restart [--model SPEC] [--trials 3] [--modes standby,cold]
                                     [--requests 16] [--max-tokens 64] [--weights fp32]
                                     [--long-prompts] [--batch-invariant]
Owns: this measurement. Does not own: the pool (justapi serve) or its restarts.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from justapi.ops.admin_cli import table
from tools.harness import ServedPool, child_pids, pid_alive

PROG = "python -m tools.bench restart"
PROMPT = "Tell me a long story about a lighthouse keeper and a storm, number "
KILL_AFTER_EVENTS = 4  # every stream has had this many events when the scheduler is killed
STANDBY_WAIT_S = 60.0  # how long a load waits for the pool's standby scheduler
RESUBMIT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) frontend0 WARNING .*"
                      r"a new scheduler \(pid \d+, restart \d+\) took over from pid (\d+):")
MODES = {"standby": (), "cold": ("--no-standby-scheduler",)}
"""standby: the successor was started ahead (the default); cold: it starts after the death."""


@dataclass
class Stream:
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    event_times: list[float] = field(default_factory=list)  # time.time() of each event


LONG_PROMPTS = False  # --long-prompts


async def _stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int,
                  out: Stream) -> None:
    prompt = f"{PROMPT}{i}." + (f" Remember the storm of year {i}." * 60 if LONG_PROMPTS and i % 4 == 3 else "")
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True, "stream": True, "temperature": 0}
    if i % 2:  # seeded sampling: it must continue exactly too
        body.update(temperature=0.8, seed=i)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                out.event_times.append(time.time())
                if "error" in event:
                    out.error = str(event["error"])
                    continue
                out.text += event["choices"][0]["text"]
                out.finish_reason = event["choices"][0]["finish_reason"] or out.finish_reason
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"


async def _load(url: str, streams: list[Stream], max_tokens: int) -> None:
    limits = httpx.Limits(max_connections=2 * len(streams))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(_stream(client, url, i, max_tokens, out)
                               for i, out in enumerate(streams)))


def trial(pool: ServedPool, kill: bool, num_requests: int, max_tokens: int,
          expected: list[Stream] | None, *,
          standby: bool = False) -> tuple[dict[str, Any], list[Stream]]:
    """One load (its streams read here while it runs); kill: SIGKILL the scheduler once every
    stream is under way (standby: once the pool has its standby scheduler again)."""
    row: dict[str, Any] = {"kill": kill, "standby": None, "resubmit_s": None,
                           "first_token_s": None, "delivered": None}
    if kill and standby:  # the one the last kill used is replaced a while after it
        _wait_for(lambda: _num_schedulers(pool) > 1, STANDBY_WAIT_S)
    streams = [Stream() for _ in range(num_requests)]
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        future = executor.submit(asyncio.run, _load(pool.base_url, streams, max_tokens))
        if kill:
            row.update(_kill_when_streaming(pool, future, streams))
        future.result()
    complete = [s.error is None and s.finish_reason == "length" for s in streams]
    row.update(completed=f"{sum(complete)}/{num_requests}", lost=num_requests - sum(complete),
               errors=sum(s.error is not None for s in streams))
    if expected is not None:
        same = sum(a.text == b.text for a, b in zip(streams, expected))
        row["same_output"] = f"{same}/{num_requests}"
    if row.get("killed_at") is not None:
        row["first_token_s"] = first_token_after(streams, row["killed_at"], row["resubmit_s"])
    return row, streams


def _kill_when_streaming(pool: ServedPool, future: concurrent.futures.Future,
                         streams: list[Stream]) -> dict[str, Any]:
    """SIGKILL the scheduler once every stream had KILL_AFTER_EVENTS events; when the
    frontend resubmitted to its successor (its log line)."""
    deadline = time.monotonic() + 600
    while min(len(s.event_times) for s in streams) < KILL_AFTER_EVENTS and not future.done() \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    standby = _num_schedulers(pool) > 1
    if future.done():  # nothing left to kill it under (raise --max-tokens)
        print(f"{PROG}: the load ended before the kill; trial void", file=sys.stderr)
        return {"standby": standby}
    victim = scheduler_pid(pool)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    delivered = sum(len(s.event_times) for s in streams)
    while pid_alive(victim):
        time.sleep(0.005)
    while not future.done() and _resubmit_time(pool, victim) is None:
        time.sleep(0.05)
    resubmitted = _resubmit_time(pool, victim)
    return {"killed_at": killed_at, "standby": standby, "delivered": delivered,
            "resubmit_s": None if resubmitted is None else resubmitted - killed_at}


def scheduler_pid(pool: ServedPool) -> int:
    """The scheduler serving now (the frontend's /health knows it)."""
    pid = int(httpx.get(f"{pool.base_url}/health", timeout=10).json()["scheduler_pid"])
    if pid not in child_pids(pool.proc.pid):
        raise SystemExit(f"{PROG}: /health names scheduler pid {pid}, not a child of the pool")
    return pid


def _num_schedulers(pool: ServedPool) -> int:
    """Scheduler processes of the pool: the serving one, and a standby started ahead."""
    count = 0
    for pid in child_pids(pool.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                count += b"justapi.scheduler.process" in handle.read()
        except OSError:
            continue
    return count


def _resubmit_time(pool: ServedPool, old_pid: int) -> float | None:
    """When the frontend resubmitted to the scheduler that followed old_pid (its log line)."""
    for line in pool.log().splitlines():
        match = RESUBMIT.match(line)
        if match and int(match.group(2)) == old_pid:
            return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def first_token_after(streams: list[Stream], killed_at: float,
                      resubmit_s: float | None) -> float | None:
    """Seconds from the kill to the first event a client got after the frontend resubmitted
    its requests (what the dead scheduler had sent reached the clients before: a new token
    needs a prefill step); without that time, to the end of the longest silence after the
    kill (all streams' events together)."""
    times = sorted(t for s in streams for t in s.event_times if t >= killed_at)
    if resubmit_s is not None:
        after = [t for t in times if t > killed_at + resubmit_s]
        return after[0] - killed_at if after else None
    if not times:
        return None
    edges = [killed_at, *times]
    gaps = [(later - earlier, later) for earlier, later in zip(edges, edges[1:])]
    return max(gaps)[1] - killed_at


def _wait_for(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    cli.add_argument("--model", default="", help="GGUF file or synthetic:SPEC (default: SmolLM2)")
    cli.add_argument("--trials", type=int, default=3, help="kills per mode, modes in turns")
    cli.add_argument("--modes", default="standby,cold", help=f"of {', '.join(MODES)}")
    cli.add_argument("--requests", type=int, default=16, help="concurrent streams per load")
    cli.add_argument("--max-tokens", type=int, default=64)
    cli.add_argument("--weights", default="", help="the pools' --weights (default: the "
                     "server's, auto; fp32 makes every step's numerics independent of the "
                     "batch, so that 'same output' measures the restart alone)")
    cli.add_argument("--long-prompts", action="store_true", help="every fourth prompt ~600 tokens")
    cli.add_argument("--batch-invariant", action="store_true", help="the pools' --batch-invariant")
    args = cli.parse_args(argv)
    global LONG_PROMPTS
    LONG_PROMPTS = args.long_prompts
    modes = [m for m in args.modes.split(",") if m]
    if args.trials < 1 or args.requests < 1 or args.max_tokens <= KILL_AFTER_EVENTS \
            or not modes or not set(modes) <= set(MODES):
        cli.error(f"needs --trials >= 1, --requests >= 1, --max-tokens > {KILL_AFTER_EVENTS}, "
                  f"--modes of {', '.join(MODES)}")
    model = (["--model", args.model] if args.model else []) + \
        (["--weights", args.weights] if args.weights else []) + \
        (["--batch-invariant"] if args.batch_invariant else [])
    pools: dict[str, ServedPool] = {}
    rows: list[dict[str, Any]] = []
    try:
        for mode in modes:  # one pool per mode, side by side
            pools[mode] = ServedPool("--log-level", "warning", *model, "--max-seqs",
                                     str(max(32, args.requests)), *MODES[mode])
        rows += _loads(pools, args.trials, args.requests, args.max_tokens)
    finally:
        codes = [pool.stop() for pool in pools.values()]
    _report(rows, codes)
    return 0


def _loads(pools: dict[str, ServedPool], trials: int, num_requests: int,
           max_tokens: int) -> list[dict[str, Any]]:
    """Per pool a baseline and a control load, then `trials` loads with a kill, pools in turns."""
    rows: list[dict[str, Any]] = []
    expected = {}
    for mode, pool in pools.items():
        row, expected[mode] = trial(pool, False, num_requests, max_tokens, None)
        rows.append({**row, "mode": mode})
        row, _ = trial(pool, False, num_requests, max_tokens, expected[mode])
        rows.append({**row, "mode": mode})
    for _ in range(trials):
        for mode, pool in pools.items():
            row, _ = trial(pool, True, num_requests, max_tokens, expected[mode],
                           standby=mode == "standby")
            rows.append({**row, "mode": mode})
    return rows


def _report(rows: list[dict[str, Any]], codes: list[int]) -> None:
    print(table(["pool", "scheduler", "standby", "events before", "resubmitted s",
                 "first token s", "completed", "lost", "errors", "same output"],
                [[r["mode"], "killed" if r["kill"] else "kept", r["standby"], r["delivered"],
                  _round(r["resubmit_s"], 2), _round(r["first_token_s"], 2), r["completed"],
                  r["lost"], r["errors"], r.get("same_output", "-")] for r in rows]))
    for mode in MODES:
        firsts = [r["first_token_s"] for r in rows
                  if r["mode"] == mode and r["first_token_s"] is not None]
        if firsts:
            print(f"{mode}: first token after the scheduler's death {min(firsts):.2f}.."
                  f"{max(firsts):.2f} s over {len(firsts)} kill(s) (target <= 3 s)")
    print(f"requests lost: {sum(r['lost'] for r in rows)} (target 0); "
          f"server exit codes {codes}")


if __name__ == "__main__":
    sys.exit(main())
