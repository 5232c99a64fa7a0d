"""`justapi serve` as a child process of a tool: on free loopback ports, from start to healthy
to stopped, with its /metrics at hand. bench_pd, bench_serve, bench_cross_host, bench_failover
and soak all drive the real pool through this.

    with Server(["--model", spec, "--workers", "2"], zmq=True) as server:
        httpx.post(f"{server.url}/v1/completions", ...)      # server.zmq: the ZMQ endpoint

Owns: the child's command line, ports, start-up wait and SIGTERM stop. Does not own: what the
tools measure.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

TOOL = Path(sys.argv[0]).stem or "tool"  # names the calling tool in errors
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m justapi.cli serve ARGS --port P [--zmq tcp://...]`, output kept in a temp file.

    `zmq=True` also opens the ZMQ client endpoint (`self.zmq`). `private_state=True` gives the
    pool a state directory of its own (JUSTAPI_STATE_DIR, set in this process too) so that
    `justapi.ops.admin_client.AdminClient()` here finds this pool and no other."""

    def __init__(self, args: Sequence[str], *, zmq: bool = False,
                 private_state: bool = False) -> None:
        if private_state:
            self.state_dir = tempfile.mkdtemp(prefix=f"justapi-{TOOL}-state-")
            os.environ["JUSTAPI_STATE_DIR"] = self.state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.zmq = f"tcp://127.0.0.1:{free_port()}" if zmq else None
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "justapi.cli", "serve", "--port", str(self.port),
             *(["--zmq", self.zmq] if self.zmq else []), "--log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{TOOL}: the server exited:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"{TOOL}: the server was not healthy in {START_TIMEOUT_S:.0f}s")

    def metrics(self, names: Sequence[str]) -> dict[str, float]:
        """The named samples of /metrics, each summed over its label sets (e.g. workers)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = dict.fromkeys(names, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in out:
                    out[sample.name] += sample.value
        return out

    def settled_metrics(self, names: Sequence[str]) -> dict[str, float]:
        """`metrics` once two reads 1 s apart agree: the scheduler pushes its figures to the
        frontend every 0.5 s, so a read right after the last reply can miss the last steps."""
        before = self.metrics(names)
        for _ in range(10):
            time.sleep(1.0)
            after = self.metrics(names)
            if after == before:
                return after
            before = after
        return before

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def __enter__(self) -> Server:
        self.wait_healthy()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int:
        """SIGTERM (a drain), SIGKILL if it hangs; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
