"""Which host each KV pool lives on, and what moving a block between two pools costs.

With workers on several hosts (launcher = "ray") every host has its own KV pool (CPU: one
shared-memory segment per host; GPU: one per device), so a block cached in a pool on another
host is not free: using it means copying its KV over the wire. Costs are fractions of
recomputing the same tokens: 0 within a pool, `same_host_copy_cost` between two pools of one
host, `cross_host_copy_cost` between hosts.
Owns: the pool -> host map and the cost rule. Does not own: the blocks (BlockPool), the
copies (prefix_import.py, pd_handoffs.py) or how bytes travel (justapi/cluster/kv_relay.py).
"""
from __future__ import annotations

from collections.abc import Iterable

from justapi.wire.protocol import PoolInfo

LOCAL_HOST = ""  # PoolInfo.host of the launcher's own host
SAME_HOST_COPY_COST = 0.02  # a memcpy between two pools of one machine: ~free next to compute
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class HostMap:
    """pool id -> PoolInfo (its host, kind, shape), from the workers' Ready messages."""

    def __init__(self, pools: Iterable[PoolInfo] = (), cross_host_copy_cost: float = 0.2,
                 same_host_copy_cost: float = SAME_HOST_COPY_COST) -> None:
        if cross_host_copy_cost < 0 or same_host_copy_cost < 0:
            raise ValueError(f"copy costs must be >= 0, got {cross_host_copy_cost!r} and "
                             f"{same_host_copy_cost!r}")
        self.cross_host_copy_cost = float(cross_host_copy_cost)
        self.same_host_copy_cost = float(same_host_copy_cost)
        self.pools: dict[int, PoolInfo] = {}
        for info in pools:
            self.add(info)

    def add(self, info: PoolInfo) -> None:
        """A pool's (new) description; a pool never moves to another host."""
        known = self.pools.get(info.pool_id)
        if known is not None and known.host != info.host:
            raise ValueError(f"pool {info.pool_id} is on host {known.host!r}, a worker reports "
                             f"it on {info.host!r}")
        self.pools[info.pool_id] = info

    def host_of(self, pool_id: int) -> str:
        info = self.pools.get(pool_id)
        return info.host if info is not None else LOCAL_HOST

    @property
    def hosts(self) -> list[str]:
        return sorted({info.host for info in self.pools.values()})

    def is_cross_host(self, src_pool_id: int, dst_pool_id: int) -> bool:
        return self.host_of(src_pool_id) != self.host_of(dst_pool_id)

    def copy_cost(self, src_pool_id: int, dst_pool_id: int) -> float:
        """Cost of one token's KV moved from src to dst, as a fraction of recomputing it."""
        if src_pool_id == dst_pool_id:
            return 0.0
        if self.is_cross_host(src_pool_id, dst_pool_id):
            return self.cross_host_copy_cost
        return self.same_host_copy_cost

    def block_bytes(self, pool_id: int) -> int:
        """Bytes of one block of the pool (all layers, K and V); 0 for an unknown pool."""
        info = self.pools.get(pool_id)
        if info is None:
            return 0
        return (info.num_layers * 2 * info.block_size * info.num_kv_heads * info.head_dim
                * DTYPE_BYTES.get(info.dtype, 4))
