"""Which pool (and so which workers) a new request goes to.

Rule (SGLang gateway's cache_aware, per pool): among pools with a healthy worker and room
for the prompt, take the one whose prefix cache holds the longest prefix of the request
(ties: lighter load, then lower id) - unless that pool is much busier than the lightest:
load(best) > load(lightest) + route_balance_abs AND load(best) > load(lightest) *
route_balance_rel, where load = (running + waiting requests) / healthy workers. With no
cached prefix anywhere, or one pool, the lightest pool wins.
Within a pool the worker is chosen at admission: idle workers are planned lightest first
(fewest running requests) and none admits beyond its fair share of the pool's requests, so
with one shared pool the least loaded worker takes the next request. A request stays on its
worker while it runs (its blocks are in that pool).
Owns: the pool choice. Does not own: loads or caches (SchedulerState, KvCacheManager).
"""
from __future__ import annotations

from justapi.scheduler.request import Request
from justapi.scheduler.state import SchedulerState


class Router:
    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.config = state.config

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
        kv = self.state.kv
        if not kv.enable_prefix_cache:
            return lightest
        tokens = req.token_bytes()
        hits = {p: kv.probe(p, tokens, req.cache_salt, req.num_tokens) for p in pools}
        best = max(pools, key=lambda p: (hits[p], -loads[p], -p))
        if hits[best] == 0 or self._is_much_busier(loads[best], loads[lightest]):
            return lightest
        return best

    def _is_much_busier(self, load: float, lightest: float) -> bool:
        return (load > lightest + self.config.route_balance_abs
                and load > lightest * self.config.route_balance_rel)
