"""What the scheduler is built over: KV pools, the workers that map them (and their roles),
and model limits.

Owns: the static shape handed to `Scheduler` and its validation. Does not own: worker
health (Scheduler.mark_worker_unhealthy) or block allocation (BlockPool).
"""
from __future__ import annotations

from dataclasses import dataclass

ROLE_MIXED = "mixed"  # colocated: prefills and decodes (Scheduler)
ROLE_PREFILL = "prefill"  # PdScheduler: prompts only, then hands the request off
ROLE_DECODE = "decode"  # PdScheduler: decodes the requests handed to it
ROLES = (ROLE_MIXED, ROLE_PREFILL, ROLE_DECODE)


def _check_id(value: object, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class PoolSpec:
    """One device KV pool: `num_blocks` blocks of `block_size` tokens."""

    pool_id: int
    num_blocks: int

    def __post_init__(self) -> None:
        _check_id(self.pool_id, "pool_id")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"pool {self.pool_id}: num_blocks must be >= 1, got {self.num_blocks!r}")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process, the pool it reads and writes, and its role (PD disaggregation)."""

    worker_id: int
    pool_id: int
    role: str = ROLE_MIXED

    def __post_init__(self) -> None:
        _check_id(self.worker_id, "worker_id")
        _check_id(self.pool_id, "pool_id")
        if self.role not in ROLES:
            raise ValueError(f"worker {self.worker_id}: role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class Topology:
    """Pools and workers. CPU: one shared pool mapped by every worker; GPU: a pool per device."""

    pools: tuple[PoolSpec, ...]
    workers: tuple[WorkerSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        object.__setattr__(self, "workers", tuple(self.workers))
        if not self.pools or not self.workers:
            raise ValueError("a topology needs at least one pool and one worker")
        pool_ids = [p.pool_id for p in self.pools]
        worker_ids = [w.worker_id for w in self.workers]
        if len(set(pool_ids)) != len(pool_ids):
            raise ValueError(f"duplicate pool ids in {pool_ids}")
        if len(set(worker_ids)) != len(worker_ids):
            raise ValueError(f"duplicate worker ids in {worker_ids}")
        for worker in self.workers:
            if worker.pool_id not in pool_ids:
                raise ValueError(f"worker {worker.worker_id} maps unknown pool {worker.pool_id}")
        for pool_id in pool_ids:
            if not any(w.pool_id == pool_id for w in self.workers):
                raise ValueError(f"pool {pool_id} has no worker")

    @classmethod
    def shared_pool(cls, num_blocks: int, num_workers: int = 1) -> Topology:
        """CPU layout: every worker maps the one pool 0."""
        return cls((PoolSpec(0, num_blocks),),
                   tuple(WorkerSpec(w, 0) for w in range(num_workers)))

    @classmethod
    def pool_per_worker(cls, num_blocks: int, num_workers: int) -> Topology:
        """GPU layout: worker w owns pool w."""
        return cls(tuple(PoolSpec(w, num_blocks) for w in range(num_workers)),
                   tuple(WorkerSpec(w, w) for w in range(num_workers)))

    @classmethod
    def pd(cls, num_blocks: int, num_prefill: int, num_decode: int,
           separate_pools: bool = False) -> Topology:
        """PD layout: workers [0, P) prefill, [P, P + D) decode. Shared: all map pool 0 (CPU,
        zero-copy hand-off); separate: prefill workers map pool 0, decode workers pool 1."""
        workers = [WorkerSpec(w, 0, ROLE_PREFILL) for w in range(num_prefill)]
        workers += [WorkerSpec(num_prefill + w, int(separate_pools), ROLE_DECODE)
                    for w in range(num_decode)]
        pools = [PoolSpec(p, num_blocks) for p in range(1 + int(separate_pools))]
        return cls(tuple(pools), tuple(workers))


@dataclass(frozen=True)
class ModelLimits:
    """Model facts the scheduler enforces: the context cap, end-of-generation ids, and where a
    LongRoPE model switches its rope table."""

    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    long_rope_context: int = 0
    """LongRoPE's original context (ModelInfo.long_rope_context; 0: not LongRoPE): a sequence
    longer than it is computed with the long table (long_rope.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if not isinstance(self.max_context, int) or self.max_context < 2:
            raise ValueError(f"max_context must be an integer >= 2, got {self.max_context!r}")
        if not isinstance(self.long_rope_context, int) or self.long_rope_context < 0:
            raise ValueError(f"long_rope_context must be an integer >= 0, got {self.long_rope_context!r}")
