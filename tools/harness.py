"""`justapi serve` as a child process, for end-to-end tests and the benchmark scenarios: on
free loopback ports, from start to healthy to stopped, with its log and /metrics at hand, and
a check that it left nothing behind (no child process, no shared-memory segment, no runtime
dir).

    with ServedPool("--model", TINY_MODEL, "--workers", "2", zmq=True) as pool:
        httpx.post(f"{pool.base_url}/v1/completions", ...)   # pool.zmq: the ZMQ endpoint

Owns: the child's command line, ports, start-up wait, stop and leftovers. Does not own: what
the tests assert or the scenarios measure.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

TINY_MODEL = "synthetic:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,context=1024"
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


class ServeError(RuntimeError):
    """`justapi serve` exited before it was healthy, or was not healthy in time; with its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (the pool's processes run in their own sessions)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServedPool:
    """`python -m justapi.cli serve ARGS --port P` on a free loopback port, ready when /health
    is 200 (ServeError otherwise, the server stopped).

    `zmq=True` also opens the ZMQ client endpoint on a free port (`self.zmq`).
    `private_state=True` gives the pool a state directory of its own (JUSTAPI_STATE_DIR, set in
    this process too) so that `AdminClient()` here finds this pool and no other.
    `cwd`: the directory the server starts in; `python -m` puts it first on sys.path, ahead of
    PYTHONPATH, so a server run from another source tree must start in that tree.
    `wrap`: a command that runs the server's command line (e.g. `unshare -m ...` in a mount
    namespace), which must exec it (the launcher keeps the process id)."""

    def __init__(self, *args: str, zmq: bool = False, private_state: bool = False,
                 ready_timeout_s: float = READY_TIMEOUT_S, cwd: str | None = None,
                 wrap: Sequence[str] = ()) -> None:
        if private_state:
            os.environ["JUSTAPI_STATE_DIR"] = tempfile.mkdtemp(prefix="justapi-state-")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.zmq = f"tcp://127.0.0.1:{free_port()}" if zmq else None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="justapi-serve-", suffix=".log",
                                                delete=False)
        # a segment some earlier, killed server left under a pid this one reuses is not ours
        self._shm_before = set(os.listdir("/dev/shm"))
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "justapi.cli", "serve", "--port", str(self.port),
             *(["--zmq", self.zmq] if self.zmq else []), *args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
        self.children: list[int] = []
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"justapi serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.children = child_pids(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ServeError(f"justapi serve not healthy in {timeout_s:.0f}s:\n{self.log()}")

    def log(self) -> str:
        with open(self._log.name) as handle:
            return handle.read()

    @property
    def runtime_dir(self) -> str | None:
        match = re.search(r"ipc://(/\S+)/client\.sock", self.log())
        return match.group(1) if match else None

    def metrics(self, names: Sequence[str]) -> dict[str, float]:
        """The named samples of /metrics, each summed over its label sets (e.g. workers)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
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

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """`signum` (SIGTERM: a drain), SIGKILL if it hangs; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def leftovers(self, settle_s: float = 5.0) -> list[str]:
        """What the pool left behind after stop(): live children, shm segments, runtime dir.
        Children get `settle_s` to finish exiting (multiprocessing's resource tracker, a child
        of the launcher, leaves only once it sees the launcher's pipe close)."""
        deadline = time.monotonic() + settle_s
        while any(pid_alive(pid) for pid in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        found = [f"process {pid}" for pid in self.children if pid_alive(pid)]
        prefix = f"justapi-kv-{self.proc.pid}-"
        found += [f"/dev/shm/{name}" for name in os.listdir("/dev/shm")
                  if name.startswith(prefix) and name not in self._shm_before]
        runtime_dir = self.runtime_dir
        if runtime_dir and os.path.exists(runtime_dir):
            found.append(runtime_dir)
        return found

    def __enter__(self) -> ServedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
        os.unlink(self._log.name)
