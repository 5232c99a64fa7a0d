"""Routing over pools on several hosts: a cached prefix in another pool is worth its blocks
less the cost of copying them (justapi/scheduler/cluster/hosts.py).

Router's rule (the longest cached prefix unless that pool is much busier than the lightest),
with the prefix measured as what a pool can get: its own cached blocks, plus the extra blocks
another pool has cached, each worth (1 - copy cost) of a local one. So with hosts A and B and
a prefix cached on A: A wins when it is not much busier; otherwise the request goes to B and
`import_source` says where B can copy the prefix from instead of recomputing it. A source
needs a healthy worker (one on its host reads the blocks).
Owns: those choices. Does not own: the copy (prefix_import.py) or loads and caches.
"""
from __future__ import annotations

from dataclasses import dataclass

from justapi.scheduler.cluster.hosts import HostMap
from justapi.scheduler.request import Request
from justapi.scheduler.router import Router
from justapi.scheduler.state import SchedulerState


@dataclass(frozen=True)
class PrefixSource:
    """A longer cached prefix of a request in another pool, worth copying into its pool."""

    pool_id: int
    num_blocks: int  # cached there
    num_local_blocks: int  # cached in the request's own pool already
    gain_blocks: float  # blocks of compute saved, net of the copy's cost


class CostAwareRouter(Router):
    def __init__(self, state: SchedulerState, hosts: HostMap) -> None:
        super().__init__(state)
        self.hosts = hosts

    def choose_pool(self, req: Request, exclude: int | None = None) -> int | None:
        pools = [p for p in self.eligible_pools(req.num_tokens) if p != exclude]
        if len(pools) <= 1:
            return pools[0] if pools else None
        loads = {pool_id: self.state.pool_load(pool_id) for pool_id in pools}
        lightest = min(pools, key=lambda p: (loads[p], p))
        if not self.state.kv.enable_prefix_cache:
            return lightest
        hits = self.cached_blocks(req)
        worth = {p: hits.get(p, 0) + self._best_import(p, hits)[1] for p in pools}
        best = max(pools, key=lambda p: (worth[p], -loads[p], -p))
        if worth[best] == 0 or self._is_much_busier(loads[best], loads[lightest]):
            return lightest
        return best

    def cached_blocks(self, req: Request) -> dict[int, int]:
        """Cached prefix blocks of req in every pool a worker can read (read-only probes)."""
        state, tokens = self.state, req.token_bytes()
        return {p: state.kv.probe(p, tokens, req.cache_salt, req.num_tokens)
                for p in state.queues if state.healthy_workers(p)}

    def import_source(self, req: Request, pool_id: int) -> PrefixSource | None:
        """Where req's pool can copy a longer prefix from, if that beats recomputing it."""
        if not self.state.kv.enable_prefix_cache:
            return None
        hits = self.cached_blocks(req)
        source, gain = self._best_import(pool_id, hits)
        if source is None or gain <= 0:
            return None
        return PrefixSource(source, hits[source], hits.get(pool_id, 0), gain)

    def _best_import(self, pool_id: int, hits: dict[int, int]) -> tuple[int | None, float]:
        """The source pool whose extra cached blocks save the most compute net of the copy."""
        local = hits.get(pool_id, 0)
        best: int | None = None
        best_gain = 0.0
        for source, num_blocks in sorted(hits.items()):
            cost = self.hosts.copy_cost(source, pool_id)
            if source == pool_id or num_blocks <= local or cost >= 1.0:
                continue
            gain = (1.0 - cost) * (num_blocks - local)
            if gain > best_gain:
                best, best_gain = source, gain
        return best, best_gain
