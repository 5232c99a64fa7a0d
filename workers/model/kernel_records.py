"""Files the CPU kernels keep beside their builds and share between processes: where they live,
which CPU they belong to, how they are changed (read-modify-write under a file lock, written
whole), and whether the host was quiet while a measurement behind them was taken.

Torch-free, so `justapi doctor` can show and reset the records without loading the data plane.
Owns: the cache directory, the records' locking and writing, the quiet-host probe.
Does not own: what a record says (path_plan.py: weight-path plans; cpu_kernels.py: the
attention products).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

CACHE_ENV = "JUSTAPI_KERNEL_CACHE"
PLANS_FILE = "weight-paths.json"
PRODUCTS_GLOB = "paged_attention-*.products.json"
QUIET_SHARE = 0.10
"""A measurement is kept for later runs only if the other processes used at most this share
of the machine's CPU time while it ran (2 vCPUs: a fifth of one core). The 1-minute load
average lags by a minute: a plan measured in the first seconds of a test run passed it and
chose a path 3x slower at one row, cached for every later start."""


SOURCE_DIR = Path(__file__).with_name("csrc")
"""The C kernels' sources (cpu_kernels.py builds them)."""


def plan_kernel_source() -> str:
    """The source a weight-path plan depends on: the matmul kernels and every header they may
    include (a plan measured on other kernels is not this build's)."""
    return "".join(path.read_text() for path in [SOURCE_DIR / "quant_matmul.c", *sorted(SOURCE_DIR.glob("*.h"))])


def plan_source_digest(source: str | None = None) -> str:
    """A short digest of plan_kernel_source(), kept in each plan record: `justapi doctor`
    tells the plans this install uses from those an older (or other) version measured."""
    text = plan_kernel_source() if source is None else source
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class KernelBuildError(RuntimeError):
    """A kernel cannot be built here (no compiler, a failed compile, or no private directory
    for the builds and their records)."""


def cpu_id() -> str:
    """What a -march=native build depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def cpu_name() -> str:
    """The CPU model as a person reads it, with a short digest of its feature flags (records
    name the CPU they were measured on: two hosts of one model may differ in features)."""
    ident = cpu_id()
    model = next((line.split(":", 1)[1].strip() for line in ident.splitlines() if line.startswith("model name")),
                 platform.machine())
    return f"{model} [{hashlib.sha256(ident.encode()).hexdigest()[:8]}]"


def cache_dir() -> Path:
    """A directory only this user can write (a library loaded from it runs as this user)."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "justapi", "kernels")
    for path in (Path(base), Path(tempfile.gettempdir()) / f"justapi-kernels-{os.getuid()}"):
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        info = path.stat()
        if info.st_uid == os.getuid() and not info.st_mode & 0o022:
            return path
    raise KernelBuildError(f"no private directory to build kernels in (tried {base})")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold `path`'s lock file (path + '.lock') exclusively: one process at a time reads,
    measures and writes the record."""
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_json(path: Path) -> dict:
    """The record's entries; {} where it is missing, torn or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, entries: dict) -> None:
    """The whole record written to a temporary file and renamed over it (readers that take no
    lock see the old file or the new one, never half of one)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)


def update_json(path: Path, change: Callable[[dict], None]) -> dict:
    """Read, `change` in place, write back, all under the record's lock (two workers that
    measure different shapes both keep theirs); returns the entries written."""
    with locked(path):
        entries = read_json(path)
        change(entries)
        write_json(path, entries)
        return entries


def record_files(directory: Path) -> list[Path]:
    """Every record file in the cache directory: the weight-path plans and the attention
    products' choices (one per kernel build)."""
    return sorted([directory / PLANS_FILE] + list(directory.glob(PRODUCTS_GLOB)))


def reset_records(directory: Path) -> list[Path]:
    """Remove every record (each under its lock); the next start measures again. Returns the
    files removed."""
    removed = []
    for path in record_files(directory):
        with locked(path):
            if path.exists():
                path.unlink()
                removed.append(path)
    return removed


@dataclass
class BusyProbe:
    """The share of the machine's CPU time other processes used between `start()` and `share()`:
    every CPU's busy time (/proc/stat, steal included) less this process's own (all its
    threads). Measured over the very window a measurement ran in, where the load average
    reports the minute before it."""

    began_s: float = 0.0
    busy_s: float = 0.0
    own_s: float = 0.0

    def start(self) -> BusyProbe:
        self.began_s, self.busy_s, self.own_s = time.monotonic(), _busy_seconds(), _own_seconds()
        return self

    def share(self) -> float:
        """Others' CPU seconds over the window's capacity (elapsed x CPUs), 0 to 1; where the
        host has no /proc/stat, the 1-minute load average over the cores."""
        cpus = os.cpu_count() or 1
        busy = _busy_seconds()
        if busy < 0 or self.busy_s < 0:
            return min(1.0, os.getloadavg()[0] / cpus)
        elapsed = max(time.monotonic() - self.began_s, 1e-3)
        others = (busy - self.busy_s) - (_own_seconds() - self.own_s)
        return min(1.0, max(0.0, others / (elapsed * cpus)))


def _busy_seconds() -> float:
    """CPU seconds every CPU spent on anything but idle and I/O wait since boot; -1 without
    /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return -1.0
    if not fields or fields[0] != "cpu":
        return -1.0
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
