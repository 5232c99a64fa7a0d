"""What memory this host gives the server: free RAM, the cgroup's memory limit, /dev/shm.

The CPU KV pool is a /dev/shm segment backed lazily: its pages are taken when a block is
first written, so a pool larger than /dev/shm's free space ends in SIGBUS, and one larger than
the cgroup allows (tmpfs pages count against the cgroup that touches them) in the OOM killer -
both mid-serving. These readings size it at start instead (shm_pool.py).
    RAM     MemAvailable (/proc/meminfo)
    cgroup  v2 memory.max - memory.current, v1 memory.limit_in_bytes - memory.usage_in_bytes,
            the page cache it can drop (inactive_file) counted as free; the tightest of the
            process's cgroup and its ancestors that the mount shows; none when unlimited
    shm     /dev/shm's free and total bytes (statvfs)
Owns: those readings. Does not own: what the pool takes of them (shm_pool.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

UNLIMITED = 1 << 60
"""A cgroup v1 limit at or above this is "no limit" (v1 writes 2^63 rounded to pages)."""
MIB = 1 << 20


@dataclass(frozen=True)
class CgroupMemory:
    limit: int
    usage: int
    reclaimable: int
    """Page cache the cgroup can drop under pressure (inactive_file)."""
    path: str
    """The limit's file (named in the line a refusal prints)."""

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage + self.reclaimable)


@dataclass(frozen=True)
class MemoryLimits:
    """This host's memory as the server may use it (bytes; None: no such limit)."""

    available: int
    cgroup: CgroupMemory | None = None
    shm_free: int | None = None
    shm_size: int | None = None

    @classmethod
    def read(cls, root: str = "/") -> MemoryLimits:
        """The readings under `root` (tests: a directory laid out like /)."""
        shm = _statvfs(os.path.join(root, "dev/shm"))
        return cls(available_memory_bytes(root), read_cgroup(root),
                   shm[0] if shm else None, shm[1] if shm else None)


def available_memory_bytes(root: str = "/") -> int:
    """MemAvailable; 4 GiB where /proc/meminfo cannot be read."""
    try:
        with open(os.path.join(root, "proc/meminfo")) as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def read_cgroup(root: str = "/") -> CgroupMemory | None:
    """The tightest memory limit over this process's cgroup and its ancestors (v2, else v1)."""
    found: list[CgroupMemory] = []
    for version, path in _cgroup_paths(root):
        base = os.path.join(root, "sys/fs/cgroup") if version == 2 else \
            os.path.join(root, "sys/fs/cgroup/memory")
        for directory in _dirs_up(base, path):
            reading = _read_v2(directory) if version == 2 else _read_v1(directory)
            if reading is not None:
                found.append(reading)
    return min(found, key=lambda c: c.free, default=None)


def _cgroup_paths(root: str) -> list[tuple[int, str]]:
    """(version, path) of this process's memory cgroups, from /proc/self/cgroup."""
    out = []
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as handle:
            for line in handle:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    out.append((2, parts[2]))
                elif "memory" in parts[1].split(","):
                    out.append((1, parts[2]))
    except OSError:
        pass
    return out


def _dirs_up(base: str, path: str) -> list[str]:
    """base/path and its parents up to base, those that exist (inside a container the mount
    shows the container's own cgroup as base: its path from /proc is not there)."""
    parts = [p for p in path.split("/") if p]
    dirs = [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]


def _read_v2(directory: str) -> CgroupMemory | None:
    limit = _read_int(os.path.join(directory, "memory.max"))
    usage = _read_int(os.path.join(directory, "memory.current"))
    if limit is None or usage is None:
        return None
    return CgroupMemory(limit, usage, _stat(directory, "inactive_file"),
                        os.path.join(directory, "memory.max"))


def _read_v1(directory: str) -> CgroupMemory | None:
    limit = _read_int(os.path.join(directory, "memory.limit_in_bytes"))
    usage = _read_int(os.path.join(directory, "memory.usage_in_bytes"))
    if limit is None or usage is None or limit >= UNLIMITED:
        return None
    return CgroupMemory(limit, usage, _stat(directory, "total_inactive_file"),
                        os.path.join(directory, "memory.limit_in_bytes"))


def _read_int(path: str) -> int | None:
    """An integer file; None when absent, unreadable or "max" (v2: no limit)."""
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(directory: str, key: str) -> int:
    try:
        with open(os.path.join(directory, "memory.stat")) as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def _statvfs(path: str) -> tuple[int, int] | None:
    """(free, total) bytes of the filesystem at path; None where it is not there."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
