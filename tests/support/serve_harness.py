"""Start the real `justapi serve` process pool for end-to-end tests, and check it leaves
nothing behind (no child process, no shared-memory segment, no runtime dir)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

TINY_MODEL = "synthetic:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,context=1024"


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
    """`python -m justapi.cli serve ARGS` on a free loopback port, ready when /health is 200."""

    def __init__(self, *args: str, ready_timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="justapi-serve-", suffix=".log",
                                                delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "justapi.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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
                raise RuntimeError(f"justapi serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.children = child_pids(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"justapi serve not healthy in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        with open(self._log.name) as handle:
            return handle.read()

    @property
    def runtime_dir(self) -> str | None:
        match = re.search(r"ipc://(/\S+)/client\.sock", self.log())
        return match.group(1) if match else None

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
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
        found += [f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if name.startswith(prefix)]
        runtime_dir = self.runtime_dir
        if runtime_dir and os.path.exists(runtime_dir):
            found.append(runtime_dir)
        return found

    def __enter__(self) -> ServedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        os.unlink(self._log.name)
