"""PdScheduler: prefill/decode disaggregation over the same core as Scheduler.

Prefill workers run prefill-only steps (admissions, chunked prompts); when a step computes a
request's prompt, its first token comes from that step and the request is handed off to the
decode side, whose workers run decode steps only - so a burst of long prompts never stalls
running streams. The block pool, prefix caches, rule, planner, results and routing are
Scheduler's; this adds the hand-off (pd_handoffs.py):

- decode workers mapping the prefill pool (CPU shared memory; GPU workers each own a pool):
  zero-copy, only ownership moves (the decode worker claims the request's blocks);
- otherwise a CopyBlocks order to a decode worker, which maps the prefill pool once through
  the handle in the order (PoolInfo from the prefill worker's Ready) and copies; the request
  is claimed only after the copy is acknowledged.

Failures lose nothing: a dead decode worker's requests are re-queued (recompute, the prefill
side's cache usually has their prompt), a dead prefill worker's prefills too; copies to a
dead worker are redone elsewhere; unclaimed hand-offs are taken back after `lease_s` (the
shell's clock arrives through tick()). With no healthy worker on one side the other side
serves colocated until it is back (problems() says so for /health).
Owns: the PD public API. Does not own: hand-off transitions (pd_handoffs.py), the rest
(Scheduler and its pieces).
"""
from __future__ import annotations

import dataclasses

from justapi.config.sections import CacheConfig, SchedulerConfig
from justapi.scheduler.batch import StepBatch
from justapi.scheduler.deltas import DeltaBuilder
from justapi.scheduler.pd.handoffs import HandOffManager
from justapi.scheduler.pd.stats import collect_pd_stats
from justapi.scheduler.scheduler import NOT_A_STEP, Scheduler, WorkerOrder
from justapi.scheduler.topology import ROLE_DECODE, ROLE_PREFILL, ModelLimits, Topology
from justapi.scheduler.worker_state import WorkerState
from justapi.wire.protocol import BlocksCopied, PoolInfo, Ready, StepResult, TokenDeltas

DEFAULT_LEASE_S = 30.0


class PdScheduler(Scheduler):
    """Scheduler with prefill workers, decode workers and the KV hand-off between them."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, topology: Topology,
                 limits: ModelLimits, lease_s: float = DEFAULT_LEASE_S) -> None:
        _check_topology(topology)
        if not config.scheduled:
            raise ValueError("PD disaggregation needs continuous batching (scheduled=True)")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        super().__init__(config, cache, topology, _decode_capped(limits, topology, cache.block_size))
        self.handoff = HandOffManager(self.state, self.planner, self.router, lease_s)

    def set_pool_info(self, info: PoolInfo) -> None:
        """Where a pool lives (a worker's Ready): copy orders carry it to decode workers."""
        self.handoff.pool_infos[info.pool_id] = info

    # ------------------------------------------------------------------ worker side
    def schedule(self) -> list[tuple[int, WorkerOrder]]:
        """Copy orders first (they may go to busy workers), then plans for idle workers."""
        self.handoff.reroute()
        orders: list[tuple[int, WorkerOrder]] = list(self.handoff.order_copies())
        return orders + super().schedule()

    def depth_of(self, worker: WorkerState) -> int:
        """No overlap on prefill workers: a computed prompt is handed off, not decoded there."""
        return 1 if worker.role == ROLE_PREFILL else self.depth

    def _plan(self, worker: WorkerState) -> StepBatch:
        batch = super()._plan(worker)
        if worker.role == ROLE_DECODE:
            self.handoff.claim(worker, batch)
        return batch

    def update(self, result: StepResult) -> TokenDeltas:
        worker = self.state.workers.get(result.worker_id)
        step = worker.in_flight[0] if worker is not None and worker.in_flight else None
        deltas = super().update(result)
        if worker is not None and step is not None and step.step_id == result.step_id \
                and worker.role == ROLE_PREFILL:
            self.handoff.after_step(worker, step.reqs)
        return deltas

    def copy_done(self, ack: BlocksCopied) -> TokenDeltas:
        """A decode worker's answer to a CopyBlocks order."""
        deltas = DeltaBuilder(NOT_A_STEP)
        self.handoff.copy_done(ack, deltas)
        return deltas.build()

    def tick(self, now_s: float) -> TokenDeltas:
        """The shell's clock: hand-off latencies and leases are measured with it."""
        self.handoff.now_s = float(now_s)
        deltas = DeltaBuilder(NOT_A_STEP)
        self.handoff.expire(deltas)
        return deltas.build()

    def _lose_worker(self, worker: WorkerState, deltas: DeltaBuilder) -> None:
        super()._lose_worker(worker, deltas)
        self.handoff.on_worker_lost(worker, deltas)
        self.handoff.reroute()

    def add_worker(self, ready: Ready) -> None:
        """A worker of the PD layout rejoined (a restart): its pool's handle may be new."""
        if ready.worker_id not in self.state.workers:
            raise ValueError(f"worker {ready.worker_id} is not part of the PD layout "
                             f"(workers {sorted(self.state.workers)})")
        super().add_worker(ready)
        self.set_pool_info(ready.pool)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, float]:
        out = super().stats()
        out.update(collect_pd_stats(self.state, self.handoff.counters, self.handoff.latency))
        return out

    def problems(self) -> list[str]:
        out = []
        for role, other in ((ROLE_PREFILL, ROLE_DECODE), (ROLE_DECODE, ROLE_PREFILL)):
            if not self.state.has_healthy(role):
                out.append(f"{role} pool has no healthy worker ({other} workers serve colocated)")
        return out


def _check_topology(topology: Topology) -> None:
    roles = {w.role for w in topology.workers}
    if roles != {ROLE_PREFILL, ROLE_DECODE}:
        raise ValueError(f"PD needs prefill and decode workers only, got roles {sorted(roles)}")


def _decode_capped(limits: ModelLimits, topology: Topology, block_size: int) -> ModelLimits:
    """A request must fit a decode pool too: cap the context at the smallest one's tokens."""
    sizes = {p.pool_id: p.num_blocks for p in topology.pools}
    smallest = min(sizes[w.pool_id] for w in topology.workers if w.role == ROLE_DECODE)
    return dataclasses.replace(limits, max_context=min(limits.max_context, smallest * block_size))
