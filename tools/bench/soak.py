"""Soak a real `justapi serve` pool: many requests with random client disconnects and aborts,
then check that nothing leaked and every request is accounted for.

Each request is one of: a whole HTTP completion, an HTTP stream read to its end, an HTTP
stream the client drops after its first event, or a ZMQ generation aborted after its first
chunk. Afterwards: no KV block held (admin status, invariants checked), every request
counted once in /metrics (`justapi:request_success_total` summed over finish reasons), and
the resident memory of the pool's processes after the first tenth of the requests compared
with the end (growth must stay under 5%).
Usage: python -m tools.bench soak [--requests 10000] [--concurrency 32] [--model SPEC]
                                  [--seed 0]
Owns: this load and its report. Does not own: the server (justapi serve).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from justapi.client import AsyncClient
from justapi.ops.admin_client import AdminClient
from tools.harness import TINY_MODEL, ServedPool

PROG = "python -m tools.bench soak"
KINDS = ("http_whole", "http_stream", "http_disconnect", "zmq_abort")
MAX_RSS_GROWTH = 0.05


@dataclass
class SoakReport:
    num_requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # (kind, finish reason or status)
    metrics_finished: float = 0.0
    """Growth of justapi:request_success_total over the run (summed over reasons)."""
    rss_first_bytes: int = 0
    rss_last_bytes: int = 0
    kv_blocks_in_use: int = -1
    invariants: str = ""
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        return self.rss_last_bytes / max(1, self.rss_first_bytes) - 1.0

    @property
    def num_lost(self) -> int:
        """Requests the server never finished or counted twice (0 when all is well)."""
        return abs(self.num_requests - int(self.metrics_finished)) + len(self.errors)

    def lines(self) -> list[str]:
        return [f"requests {self.num_requests} in {self.seconds:.1f} s "
                f"({self.num_requests / max(self.seconds, 1e-9):.0f}/s)",
                "outcomes " + ", ".join(f"{k}:{r} {n}" for (k, r), n in
                                        sorted(self.outcomes.items())),
                f"counted in /metrics {int(self.metrics_finished)}; lost {self.num_lost}",
                f"KV blocks in use after the run {self.kv_blocks_in_use}; {self.invariants}",
                f"private RSS (RssAnon) of the pool after the first tenth {self.rss_first_bytes / 2**20:.1f} MiB, "
                f"at the end {self.rss_last_bytes / 2**20:.1f} MiB "
                f"(growth {100 * self.rss_growth:+.2f}%, limit {100 * MAX_RSS_GROWTH:.0f}%)"]


def pool_rss_bytes(launcher_pid: int) -> int:
    """Private resident memory (RssAnon) of the launcher's children (frontend, scheduler,
    workers). Shared-memory pages are left out: the KV pool's pages become resident as blocks
    are first used (the prefix cache keeps filling the pool), which is not growth of the
    processes' own memory."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                    continue
            with open(f"/proc/{entry}/status") as handle:
                for line in handle:
                    if line.startswith("RssAnon:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def finished_total(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("justapi:request_success_total{"))


async def one_request(kind: str, rng: random.Random, http: httpx.AsyncClient,
                      zmq: AsyncClient) -> str:
    """Run one request of `kind`; its finish reason (or HTTP status) for the report."""
    prompt, max_tokens = f"soak {rng.randrange(10**6)} " * rng.randint(1, 8), rng.randint(4, 40)
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.8])}
    if kind == "http_whole":
        response = await http.post("/v1/completions", json=body)
        if response.status_code != 200:
            return f"status {response.status_code}"
        return response.json()["choices"][0]["finish_reason"]
    if kind == "zmq_abort":
        stream = zmq.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
        reason = ""
        async for chunk in stream:
            if not reason:
                await zmq.abort(chunk.client_request_id)
            reason = chunk.finish_reason or "open"
        return reason
    reason = "dropped"
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if kind == "http_disconnect" and line.startswith("data: "):
                return "dropped"  # leaving the block closes the connection mid-stream
            if '"finish_reason":"' in line:
                reason = line.split('"finish_reason":"', 1)[1].split('"', 1)[0]
    return reason


async def soak(base_url: str, zmq_endpoint: str, launcher_pid: int, num_requests: int,
               concurrency: int, seed: int, admin: str | None = None) -> SoakReport:
    """admin: the server's admin endpoint (None: the newest live server's, by discovery)."""
    rng = random.Random(seed)
    report = SoakReport(num_requests=num_requests)
    finished_before = finished_total(base_url)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(num_requests):
        queue.put_nowait(index)
    num_done = 0
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http, \
            AsyncClient(zmq_endpoint) as zmq:
        async def worker() -> None:
            nonlocal num_done
            while not queue.empty():
                queue.get_nowait()
                kind = rng.choice(KINDS)
                try:
                    report.outcomes[(kind, await one_request(kind, rng, http, zmq))] += 1
                except Exception as exc:  # a failed request is a finding, not a crash
                    report.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                num_done += 1
                if num_done == max(1, num_requests // 10):
                    report.rss_first_bytes = pool_rss_bytes(launcher_pid)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        report.seconds = time.monotonic() - started
    await settle(report, admin)
    report.metrics_finished = finished_total(base_url) - finished_before
    report.rss_last_bytes = pool_rss_bytes(launcher_pid)
    return report


async def settle(report: SoakReport, endpoint: str | None, timeout_s: float = 60.0) -> None:
    """Wait for the last aborts to land, then read the block table and check invariants."""
    deadline = time.monotonic() + timeout_s
    with AdminClient(endpoint, timeout_s=30) as admin:
        while time.monotonic() < deadline:
            stats = admin.status().stats
            if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the frontend's last stats and counters
        report.kv_blocks_in_use = int(admin.status().stats["kv_blocks_in_use"])
        check = admin.check_invariants()
        report.invariants = ("invariants hold" if check.ok else "INVARIANT VIOLATED: ") + \
            ("" if check.ok else check.message)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--model", default=TINY_MODEL)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with ServedPool("--log-level", "warning", "--model", args.model, "--pool-blocks", "1024",
                    "--max-seqs", "64", "--max-decode", "64", zmq=True,
                    private_state=True) as server:
        assert server.zmq is not None
        report = asyncio.run(soak(server.base_url, server.zmq, server.proc.pid, args.requests,
                                  args.concurrency, args.seed))
        code = server.stop()
    print("\n".join(report.lines()))
    print(f"server stopped with exit code {code}")
    for error in report.errors[:10]:
        print(f"error: {error}")
    is_ok = (report.num_lost == 0 and report.kv_blocks_in_use == 0 and code == 0
             and report.invariants == "invariants hold" and report.rss_growth < MAX_RSS_GROWTH)
    print("PASS" if is_ok else "FAIL")
    return 0 if is_ok else 1


if __name__ == "__main__":
    sys.exit(main())
