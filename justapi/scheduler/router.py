"""Which pool (and so which workers) a new request goes to, and where its pool can import
a cached prefix from.

Rule (SGLang gateway's cache_aware, per pool): among pools with a healthy worker and room
for the prompt, take the one whose cached prefix of the request is worth the most (ties:
lighter load, then lower id) - unless that pool is much busier than the lightest:
load(best) > load(lightest) + route_balance_abs AND load(best) > load(lightest) *
route_balance_rel, where load = (running + waiting requests) / healthy workers. With no
cached prefix anywhere, or one pool, the lightest pool wins.
A pool's prefix is worth its own cached blocks. With pools on several hosts (a HostMap passed
in, launcher = "ray") it is worth, in addition, the extra blocks another pool has cached, each
at (1 - copy cost) of a local one: with a prefix cached on host A, A wins unless it is much
busier; otherwise the request goes to B and `import_source` says where B can copy the prefix
from (justapi/scheduler/cluster/imports.py) instead of recomputing it.
Within a pool the worker is chosen at admission: idle workers are planned lightest first
(fewest running requests) and none admits beyond its fair share of the pool's requests, so
with one shared pool the least loaded worker takes the next request. A request stays on its
worker while it runs (its blocks are in that pool).
Owns: the pool choice. Does not own: loads or caches (SchedulerState, KvCacheManager), copy
costs (HostMap), the copies (cluster/prefix_import.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from justapi.scheduler.cluster.hosts import HostMap
from justapi.scheduler.request import Request
from justapi.scheduler.state import SchedulerState


@dataclass(frozen=True)
class PrefixSource:
    """A longer cached prefix of a request in another pool, worth copying into its pool."""

    pool_id: int
    num_blocks: int  # cached there
    num_local_blocks: int  # cached in the request's own pool already
    gain_blocks: float  # blocks of compute saved, net of the copy's cost


class Router:
    def __init__(self, state: SchedulerState, hosts: HostMap | None = None) -> None:
        """hosts: where each pool lives and what copying between two costs; None when no
        prefix is ever copied between pools (one host)."""
        self.state = state
        self.config = state.config
        self.hosts = hosts

    def eligible_pools(self, num_tokens: int) -> list[int]:
        """Pools with a healthy worker whose capacity holds num_tokens + 1 tokens; those
        with a worker that is not draining, when there are any."""
        state = self.state
        pools = [pool_id for pool_id in state.queues
                 if state.healthy_workers(pool_id)
                 and state.pool_capacity_tokens(pool_id) >= num_tokens + 1]
        accepting = [pool_id for pool_id in pools if state.accepting_workers(pool_id)]
        return accepting or pools

    def choose_pool(self, req: Request, exclude: int | None = None) -> int | None:
        """The pool for req, or None when no healthy pool can hold it."""
        pools = [p for p in self.eligible_pools(req.num_tokens) if p != exclude]
        if len(pools) <= 1:
            return pools[0] if pools else None
        loads = {pool_id: self.state.pool_load(pool_id) for pool_id in pools}
        lightest = min(pools, key=lambda p: (loads[p], p))
        if not self.state.kv.enable_prefix_cache:
            return lightest
        worth = self._prefix_worth(req, pools)
        best = max(pools, key=lambda p: (worth[p], -loads[p], -p))
        if worth[best] == 0 or self._is_much_busier(loads[best], loads[lightest]):
            return lightest
        return best

    def _prefix_worth(self, req: Request, pools: list[int]) -> dict[int, float]:
        """Blocks of req's prefix each pool has, cached or (several hosts) net of a copy."""
        if self.hosts is None:
            tokens = req.token_bytes()
            return {p: self.state.kv.probe(p, tokens, req.cache_salt, req.num_tokens)
                    for p in pools}
        hits = self.cached_blocks(req)
        return {p: hits.get(p, 0) + self._best_import(p, hits)[1] for p in pools}

    def _is_much_busier(self, load: float, lightest: float) -> bool:
        return (load > lightest + self.config.route_balance_abs
                and load > lightest * self.config.route_balance_rel)

    # ------------------------------------------------------------------ prefix imports
    def cached_blocks(self, req: Request) -> dict[int, int]:
        """Cached prefix blocks of req in every pool a worker can read (read-only probes)."""
        state, tokens = self.state, req.token_bytes()
        return {p: state.kv.probe(p, tokens, req.cache_salt, req.num_tokens)
                for p in state.queues if state.healthy_workers(p)}

    def import_source(self, req: Request, pool_id: int) -> PrefixSource | None:
        """Where req's pool can copy a longer prefix from, if that beats recomputing it
        (never without a HostMap)."""
        if self.hosts is None or not self.state.kv.enable_prefix_cache:
            return None
        hits = self.cached_blocks(req)
        source, gain = self._best_import(pool_id, hits)
        if source is None or gain <= 0:
            return None
        return PrefixSource(source, hits[source], hits.get(pool_id, 0), gain)

    def _best_import(self, pool_id: int, hits: dict[int, int]) -> tuple[int | None, float]:
        """The source pool whose extra cached blocks save the most compute net of the copy."""
        assert self.hosts is not None
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
