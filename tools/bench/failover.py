"""Failure-handling figures of a real `justapi serve` pool: how fast a worker that is killed
(SIGKILL) or stopped (SIGSTOP) mid-load is marked unhealthy, how long its replacement takes
to rejoin (--restart-workers), and whether every request of the load still completed with
no KV block leaked. Prints one row per trial and a summary.

The first row runs the same load with no failure, for comparison.
Usage: python -m tools.bench failover [--model SPEC] [--trials 6] [--requests 8]
                                      [--max-tokens 200]
Owns: this measurement. Does not own: the pool (justapi serve) or its verdicts.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from justapi.ops.admin_cli import table
from justapi.ops.admin_client import AdminClient
from tools.harness import TINY_MODEL, ServedPool

PROG = "python -m tools.bench failover"
PROMPT = "a worker of the pool fails while it decodes; the scheduler notices "


class FailoverServer:
    """A pool with --restart-workers and a private state dir, and an admin client on it."""

    def __init__(self, model: str, workers: int) -> None:
        self.pool = ServedPool("--log-level", "warning", "--model", model, "--workers",
                               str(workers), "--restart-workers", "--pool-blocks", "1024",
                               private_state=True)
        self.url = self.pool.base_url
        try:
            self.admin = AdminClient(timeout_s=10)
        except BaseException:
            self.pool.stop()
            raise

    def status(self) -> Any:
        return self.admin.status()

    def stop(self) -> int:
        self.admin.close()
        return self.pool.stop()


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise SystemExit(f"{PROG}: timed out waiting for {what}")


def complete(url: str, prompt: str, max_tokens: int) -> tuple[bool, float]:
    """(all tokens came back, when it finished)."""
    response = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    ok = response.status_code == 200 and \
        response.json()["usage"]["completion_tokens"] == max_tokens
    return ok, time.monotonic()


def trial(server: FailoverServer, signum: int | None, num_requests: int,
          max_tokens: int) -> dict[str, Any]:
    """One load; signum None runs it without a failure (the baseline)."""
    workers = server.status().workers
    victim = workers[-1] if signum == signal.SIGKILL else workers[0]
    worker_id, pid = victim["worker_id"], victim["pid"]
    row: dict[str, Any] = {"signal": "none", "worker": None, "detect_s": None, "reason": None,
                           "rejoin_s": None}
    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        start = time.monotonic()
        futures = [pool.submit(complete, server.url, f"{i} {PROMPT}", max_tokens)
                   for i in range(num_requests)]
        if signum is not None:
            row.update(_fail_one(server, signum, worker_id, pid))
        results = [f.result() for f in futures]
    wait_for(lambda: server.status().stats["num_requests_running"] == 0, 60, "idle")
    row.update(load_s=max(finished for _, finished in results) - start,
               completed=f"{sum(ok for ok, _ in results)}/{num_requests}",
               leaked_blocks=int(server.status().stats["kv_blocks_in_use"]))
    return row


def _fail_one(server: FailoverServer, signum: int, worker_id: int, pid: int) -> dict[str, Any]:
    wait_for(lambda: _row(server, worker_id)["num_requests_running"], 60, "requests to run")
    os.kill(pid, signum)
    hit = time.monotonic()
    down = wait_for(lambda: not (row := _row(server, worker_id))["healthy"] and row, 60,
                    "the verdict")
    detected = time.monotonic()
    wait_for(lambda: (row := _row(server, worker_id))["healthy"] and row["pid"] != pid, 300,
             "the replacement")
    return {"signal": signal.Signals(signum).name, "worker": worker_id,
            "detect_s": detected - hit, "reason": down["reason"],
            "rejoin_s": time.monotonic() - hit}


def _row(server: FailoverServer, worker_id: int) -> dict:
    return next(w for w in server.status().workers if w["worker_id"] == worker_id)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    cli.add_argument("--model", default=TINY_MODEL, help="GGUF file or synthetic:SPEC")
    cli.add_argument("--workers", type=int, default=2)
    cli.add_argument("--trials", type=int, default=6, help="alternately SIGKILL and SIGSTOP")
    cli.add_argument("--requests", type=int, default=8, help="concurrent requests per trial")
    cli.add_argument("--max-tokens", type=int, default=200)
    args = cli.parse_args(argv)
    if args.workers < 2 or args.trials < 1 or args.requests < 1:
        cli.error("needs --workers >= 2, --trials >= 1 and --requests >= 1")
    server = FailoverServer(args.model, args.workers)
    try:
        rows = [trial(server, None, args.requests, args.max_tokens)]
        rows += [trial(server, (signal.SIGKILL, signal.SIGSTOP)[i % 2], args.requests,
                       args.max_tokens) for i in range(args.trials)]
    finally:
        server.stop()
    print(table(["signal", "worker", "detected s", "reason", "rejoined s", "load s",
                 "completed", "leaked blocks"],
                [[r["signal"], r["worker"], _round(r["detect_s"], 3), r["reason"],
                  _round(r["rejoin_s"], 2), _round(r["load_s"], 2), r["completed"],
                  r["leaked_blocks"]] for r in rows]))
    for name in ("SIGKILL", "SIGSTOP"):
        detect = [r["detect_s"] for r in rows if r["signal"] == name]
        if detect:
            print(f"{name}: detected in {min(detect):.3f}..{max(detect):.3f}s over {len(detect)} "
                  f"trial(s) (requirement: within 2 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
