"""The CPU KV pool's shared-memory segment, created and unlinked by the launcher.

All CPU workers map this one segment as the pool tensor
`[layers, 2, num_blocks, block_size, kv_heads, head_dim]` (f16 by default, bf16 or fp32 as
`--kv-cache-dtype` says), so a block cached by one worker serves requests on another -
except with `--pd P:D --pd-separate-pools`, where the prefill workers map pool 0 and the
decode workers pool 1, each its own segment (PoolSegments).
The launcher owns their lifetime: it unlinks them at shutdown even if workers were killed.
Owns: sizing and the segments. Does not own: the tensor view (workers/kv/pool.py) or which
blocks are in use (scheduler BlockPool).
"""
from __future__ import annotations

import os
import secrets
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory
from typing import Any

from justapi.config.pd import PdConfig
from justapi.config.sections import CacheConfig, ConfigError, SchedulerConfig
from justapi.model.info import ModelInfo

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MIN_BLOCKS = 4


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


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def plan_cpu_pool(model: ModelInfo, cache: CacheConfig, sched: SchedulerConfig) -> PoolPlan:
    """Blocks from --pool-blocks, else a fraction of free RAM capped at what max_seqs full
    contexts could ever use."""
    dtype = cache.pool_dtype("cpu")
    plan = PoolPlan(model.num_layers, 1, cache.block_size, model.num_kv_heads, model.head_dim, dtype)
    num_blocks = cache.pool_blocks
    if num_blocks == 0:
        by_memory = int(available_memory_bytes() * cache.kv_memory_fraction) // plan.bytes_per_block
        by_need = sched.max_seqs * -(-model.context_length // cache.block_size)
        num_blocks = max(MIN_BLOCKS, min(by_memory, by_need))
    if num_blocks * plan.bytes_per_block > available_memory_bytes():
        raise ConfigError(f"pool-blocks={num_blocks} needs {num_blocks * plan.bytes_per_block} "
                          "bytes, more than the free memory")
    return PoolPlan(model.num_layers, num_blocks, cache.block_size, model.num_kv_heads,
                    model.head_dim, dtype)


class SharedPoolSegment:
    def __init__(self, shm: shared_memory.SharedMemory, plan: PoolPlan) -> None:
        self.shm = shm
        self.plan = plan

    @classmethod
    def create(cls, plan: PoolPlan) -> SharedPoolSegment:
        name = f"justapi-kv-{os.getpid()}-{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=plan.num_bytes)
        return cls(shm, plan)

    def describe(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.shm.name, **asdict(self.plan)}

    def unlink(self) -> None:
        self.shm.close()
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


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
