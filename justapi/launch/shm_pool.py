"""The CPU KV pool's shared-memory segment, created and unlinked by the launcher.

All CPU workers map this one segment as the pool tensor
`[layers, 2, num_blocks, block_size, kv_heads, head_dim]` (f16 by default, bf16 or fp32 as
`--kv-cache-dtype` says), so a block cached by one worker serves requests on another -
except with `--pd P:D --pd-separate-pools`, where the prefill workers map pool 0 and the
decode workers pool 1, each its own segment (PoolSegments).
The launcher owns their lifetime: it unlinks them at shutdown even if workers were killed, and
holds a shared flock on each while it lives; a launcher killed outright (SIGKILL, the OOM
killer) cannot unlink its segment, so the next start removes segments that no live launcher
locks (sweep_stale_segments) before it sizes its own.
Sized at start to what free RAM, the cgroup's memory limit and /dev/shm allow
(memory_limits.py), or the server refuses to start with one line naming the limit and the flag.
Owns: sizing and the segments. Does not own: the tensor view (workers/kv/pool.py) or which
blocks are in use (scheduler BlockPool).
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory
from typing import Any

from justapi.config.pd import PdConfig
from justapi.config.sections import CacheConfig, ConfigError, SchedulerConfig
from justapi.launch.memory_limits import MIB, MemoryLimits
from justapi.model.info import ModelInfo
from justapi.wire.protocol import SHM_PREFIX, shm_creator_pid, shm_name

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHM_DIR = "/dev/shm"
STALE_AGE_S = 60.0
"""A segment no launcher locks is removed only when it is at least this old: a launcher locks
its segment right after creating it, so a younger one may be another start's, not yet locked."""
MIN_BLOCKS = 4
SHM_SHARE = 0.9
"""Of /dev/shm's free space, what an automatically sized pool takes (others use it too)."""
CONTROL_BYTES = 256 * MIB
"""The launcher, frontend and scheduler (~175 MiB resident serving SmolLM2, docs/reliability.md)."""
WORKER_BYTES = 192 * MIB
"""A worker's runtime beside its weights (SmolLM2's worker: ~290 MiB resident + its 94 MiB file)."""


@dataclass(frozen=True)
class PoolPlan:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


def plan_cpu_pool(model: ModelInfo, cache: CacheConfig, sched: SchedulerConfig, *,
                  num_workers: int = 1, num_pools: int = 1,
                  limits: MemoryLimits | None = None) -> PoolPlan:
    """Blocks from --pool-blocks, else kv-memory-fraction of the free memory (RAM, or what the
    cgroup leaves if less), capped at what max_seqs full contexts could ever use, at what the
    cgroup leaves beside the server's processes (process_needs_bytes) and at SHM_SHARE of
    /dev/shm's free space; num_pools segments of that size (PD with separate pools: 2).
    ConfigError (one line naming the limit and the flag) where they do not fit."""
    limits = limits if limits is not None else MemoryLimits.read()
    dtype = cache.pool_dtype("cpu")
    one = PoolPlan(model.num_layers, 1, cache.block_size, model.num_kv_heads, model.head_dim, dtype)
    per_block = one.bytes_per_block * num_pools
    reserve = process_needs_bytes(model.path, num_workers)
    num_blocks = cache.pool_blocks or _auto_blocks(model, cache, sched, per_block, reserve, limits)
    _check_fits(num_blocks, per_block, reserve, limits)
    return PoolPlan(model.num_layers, num_blocks, cache.block_size, model.num_kv_heads,
                    model.head_dim, dtype)


def process_needs_bytes(model_path: str, num_workers: int) -> int:
    """What the server's processes need beside the pool: the control processes, and per
    worker its runtime and twice the model file (weights repacked beside the mapped file)."""
    try:
        model_bytes = os.path.getsize(model_path)
    except OSError:
        model_bytes = 0
    return CONTROL_BYTES + num_workers * (WORKER_BYTES + 2 * model_bytes)


def _auto_blocks(model: ModelInfo, cache: CacheConfig, sched: SchedulerConfig, per_block: int,
                 reserve: int, limits: MemoryLimits) -> int:
    cgroup = limits.cgroup
    free = limits.available if cgroup is None else min(limits.available, cgroup.free)
    room = int(free * cache.kv_memory_fraction)
    if cgroup is not None:
        room = min(room, cgroup.free - reserve)
    if limits.shm_free is not None:
        room = min(room, int(limits.shm_free * SHM_SHARE))
    by_need = sched.max_seqs * -(-model.context_length // cache.block_size)
    num_blocks = min(max(0, room) // per_block, by_need)
    if num_blocks < MIN_BLOCKS:
        raise ConfigError(_too_small(num_blocks, per_block, reserve, limits))
    return num_blocks


def _too_small(num_blocks: int, per_block: int, reserve: int, limits: MemoryLimits) -> str:
    """Why the sized pool holds fewer than MIN_BLOCKS: the tightest limit, and what to change."""
    cgroup = limits.cgroup
    if limits.shm_free is not None and limits.shm_free * SHM_SHARE < MIN_BLOCKS * per_block:
        return (f"/dev/shm has {_mib(limits.shm_free)} MiB free, room for {num_blocks} KV blocks "
                f"of {per_block / 1024:.0f} KiB, fewer than {MIN_BLOCKS}: give /dev/shm more room "
                "(docker run --shm-size=1g)")
    if cgroup is not None and cgroup.free - reserve < MIN_BLOCKS * per_block:
        return (f"the cgroup memory limit ({cgroup.path}: {_mib(cgroup.limit)} MiB, "
                f"{_mib(cgroup.usage)} MiB in use) leaves no room for a KV pool beside the "
                f"~{_mib(reserve)} MiB the server's processes need: raise the limit (docker run "
                "--memory) or use fewer --workers")
    return (f"{_mib(limits.available)} MiB of free memory leaves room for {num_blocks} KV blocks, "
            f"fewer than {MIN_BLOCKS}: raise --kv-memory-fraction or set --pool-blocks")


def _check_fits(num_blocks: int, per_block: int, reserve: int, limits: MemoryLimits) -> None:
    need = num_blocks * per_block
    what = f"the KV pool of {num_blocks} blocks needs {_mib(need)} MiB"
    if limits.shm_free is not None and need > limits.shm_free:
        raise ConfigError(f"{what} of /dev/shm, which has {_mib(limits.shm_free)} MiB free: lower "
                          f"--pool-blocks (at most {limits.shm_free // per_block}) or give "
                          "/dev/shm more room (docker run --shm-size)")
    cgroup = limits.cgroup
    if cgroup is not None and need + reserve > cgroup.free:
        raise ConfigError(f"{what} beside the ~{_mib(reserve)} MiB the server's processes need, "
                          f"and the cgroup memory limit ({cgroup.path}: {_mib(cgroup.limit)} MiB, "
                          f"{_mib(cgroup.usage)} MiB in use) leaves {_mib(cgroup.free)} MiB: lower "
                          f"--pool-blocks (at most {max(0, cgroup.free - reserve) // per_block}) "
                          "or raise the limit (docker run --memory)")
    if need > limits.available:
        raise ConfigError(f"{what}, more than the {_mib(limits.available)} MiB of free memory: "
                          f"lower --pool-blocks (at most {limits.available // per_block})")


def _mib(num_bytes: int) -> int:
    return num_bytes // MIB


class SharedPoolSegment:
    def __init__(self, shm: shared_memory.SharedMemory, plan: PoolPlan) -> None:
        self.shm = shm
        self.plan = plan
        self.lock_fd = _lock_shared(shm.name)
        """A shared flock on the segment while this launcher lives (sweep_stale_segments)."""

    @classmethod
    def create(cls, plan: PoolPlan) -> SharedPoolSegment:
        shm = shared_memory.SharedMemory(name=shm_name(), create=True, size=plan.num_bytes)
        return cls(shm, plan)

    def describe(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.shm.name, **asdict(self.plan)}

    def unlink(self) -> None:
        self.shm.close()
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def _lock_shared(name: str) -> int | None:
    """An fd of /dev/shm/`name` holding a shared flock (None where there is no /dev/shm)."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def sweep_stale_segments(directory: str = SHM_DIR, min_age_s: float = STALE_AGE_S) -> list[str]:
    """Remove the KV segments (SHM_PREFIX) in `directory` that no live launcher holds a lock
    on, that are at least `min_age_s` old and whose creator's pid (in the name) is no live
    process here: what a launcher killed outright left. A flock belongs to the open file, so a
    launcher in another pid namespace sharing /dev/shm (another container) keeps its own
    segment; the kernel drops a killed launcher's lock. The pid check keeps the unlocked segment
    of an older version's server that still runs here (a reused pid keeps a stale one a while
    longer). Returns the names removed. Segments of other users (unreadable) are left alone."""
    removed: list[str] = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(SHM_PREFIX))
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a launcher holds it
            info = os.fstat(fd)
            if time.time() - info.st_mtime < min_age_s or _pid_alive(name):
                continue
            os.unlink(path)
            removed.append(name)
            log.warning("removed the KV segment %s/%s (%d MiB) that a killed server left", directory, name,
                        info.st_size // MIB)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _pid_alive(name: str) -> bool:
    """Whether the creator's pid in a segment's name (shm_creator_pid) is a live process here."""
    pid = shm_creator_pid(name)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class PoolSegments:
    """Every CPU KV segment of a deployment by pool id, and which one each worker maps."""

    def __init__(self, segments: dict[int, SharedPoolSegment], pd: PdConfig) -> None:
        self.segments = segments
        self.pd = pd

    @classmethod
    def create(cls, plan: PoolPlan, pd: PdConfig) -> PoolSegments:
        num_pools = 2 if pd.pd_separate_pools else 1
        segments: dict[int, SharedPoolSegment] = {}
        try:
            for pool_id in range(num_pools):
                segments[pool_id] = SharedPoolSegment.create(plan)
        except BaseException:
            for segment in segments.values():
                segment.unlink()
            raise
        return cls(segments, pd)

    def describe(self) -> dict[str, Any]:
        """Pool 0 (what every worker maps unless the PD sides have their own)."""
        return self.for_worker(0)

    def for_worker(self, index: int) -> dict[str, Any]:
        pool_id = self.pd.cpu_pool_of(index) if self.pd.is_enabled else 0
        return {**self.segments[pool_id].describe(), "pool_id": pool_id}

    def unlink(self) -> None:
        for segment in self.segments.values():
            segment.unlink()
