"""Whole-state consistency checks (O(requests + blocks): tests and simulation only).

Beyond BlockPool's conservation and each tree's structure: every block's holders are exactly
the requests whose block tables list it (plus PD copies in flight, under their own holder); a
request's first num_cached_blocks blocks are the path to its cache_node; waiting requests hold
nothing; running ones are on a healthy worker and handed-off ones on none, and both hold
blocks for every computed token; in-flight flags match the workers' steps and PD copies;
LongRoPE's table of each request agrees with its salt and length.
Owns: nothing. Does not own: the rules it checks (documented where they are kept).
"""
from __future__ import annotations

from collections import defaultdict

from justapi.scheduler.long_rope import LONG_TABLE_SALT
from justapi.scheduler.request import Request, RequestStatus
from justapi.scheduler.state import SchedulerState
from justapi.scheduler.worker_state import InFlightStep


def check_state(state: SchedulerState) -> None:
    state.pool.check_invariants()
    for cache in state.kv.caches.values():
        cache.check_invariants()
    for queue in state.queues.values():
        queue.check_invariants()
    in_flight = {r.request_id for w in state.workers.values() for step in w.in_flight
                 for r in step.reqs} | state.handoffs.in_flight_request_ids()
    holders: dict[int, set[str]] = defaultdict(set)
    for req in state.requests.values():
        _check_request(state, req, req.request_id in in_flight)
        for block_id in req.block_ids:
            holders[block_id].add(req.request_id)
    for worker in state.workers.values():  # overlap: duplicates a step in flight may still read
        _check_steps(worker.in_flight)
        for step in worker.in_flight:
            for block_id, holder in step.deferred_blocks:
                holders[block_id].add(holder)
    for holder, block_ids in state.handoffs.holdings():  # PD copies in flight
        for block_id in block_ids:
            holders[block_id].add(holder)
    for pool_id in state.pool.pool_ids:
        base = state.pool.base(pool_id)
        for block_id in range(base, base + state.pool.num_blocks(pool_id)):
            assert state.pool.holders(block_id) == holders.get(block_id, set()), \
                f"block {block_id}: pool holders {set(state.pool.holders(block_id))} != " \
                f"request tables {holders.get(block_id, set())}"
    for pool_id, queue in state.queues.items():
        waiting = [r for r in state.requests.values()
                   if r.status is RequestStatus.WAITING and r.pool_id == pool_id]
        assert len(queue) == len(waiting), f"pool {pool_id} queue {len(queue)} != {len(waiting)}"
        reserved = state.reservations[pool_id]
        assert reserved is None or reserved.status is RequestStatus.RUNNING


def _check_request(state: SchedulerState, req: Request, is_in_flight: bool) -> None:
    rid = req.request_id
    _check_long_rope(state, req)
    assert req.is_in_flight == is_in_flight, f"{rid}: in-flight flag disagrees with the workers"
    assert req.num_tokens < req.max_len + bool(req.pooling) or req.is_in_flight, \
        f"{rid}: past its context cap"  # (a pooling request's prompt may fill it: no output)
    if req.status is RequestStatus.WAITING:
        assert req.queue_entry is not None and not req.block_ids, f"{rid}: waiting but holds blocks"
        assert req.num_computed_tokens == 0 and req.cache_node is None
        return
    if req.status is RequestStatus.HANDOFF:
        _check_handoff(state, req)
        return
    assert req.status is RequestStatus.RUNNING, f"{rid}: finished but still tracked"
    assert not req.is_finishing or is_in_flight, f"{rid}: finishing with no step in flight"
    worker = state.workers[req.worker_id]
    assert worker.is_healthy and worker.running.get(rid) is req and rid in worker.known
    assert state.pool_running[req.pool_id].get(rid) is req and req.queue_entry is None
    assert worker.pool_id == req.pool_id
    assert all(state.pool.pool_of(b) == req.pool_id for b in req.block_ids), f"{rid}: wrong pool"
    assert req.num_computed_tokens < req.num_tokens or is_in_flight, \
        f"{rid}: nothing left to compute between steps"
    needed = state.kv.num_blocks_for(req.num_computed_tokens)
    assert len(req.block_ids) >= needed, f"{rid}: {len(req.block_ids)} blocks < {needed} needed"
    _check_cached_path(state, req)


def _check_long_rope(state: SchedulerState, req: Request) -> None:
    """LongRoPE (long_rope.py): the long table is taken for good with its salt, by a request
    longer than the original context; the short table never computes past that context, and
    a waiting request has taken its table."""
    original = state.limits.long_rope_context
    rid = req.request_id
    if req.uses_long_rope:
        assert original and req.num_tokens > original, f"{rid}: long table, short sequence"
        assert req.cache_salt.endswith(LONG_TABLE_SALT), f"{rid}: long table, short salt"
    elif original:
        assert req.num_computed_tokens <= original, f"{rid}: short table past the original context"
        assert req.status is not RequestStatus.WAITING or req.num_tokens <= original, \
            f"{rid}: queued on the short table past the original context"


def _check_steps(steps: list[InFlightStep]) -> None:
    """Steps in flight on one worker: in dispatch order; a request is in at most one that has
    not started (all but the oldest), and the latest step that has it is its last_step_id."""
    assert [s.step_id for s in steps] == sorted(s.step_id for s in steps)
    latest: dict[str, int] = {}
    for step in steps:
        for req in step.reqs:
            assert req.request_id not in latest or step is steps[-1], \
                f"{req.request_id}: in more than two steps in flight"
            latest[req.request_id] = step.step_id
    for step in steps:
        for req in step.reqs:
            assert req.last_step_id == latest[req.request_id], f"{req.request_id}: last step"


def _check_cached_path(state: SchedulerState, req: Request) -> None:
    if req.cache_node is None:
        assert req.num_cached_blocks == 0, f"{req.request_id}: cached blocks without a node"
        return
    path = [n for n in reversed(req.cache_node.path_to_root()) if not n.is_root]
    path_ids = [b for node in path for b in node.block_ids]
    assert req.cache_node.is_alive and req.cache_node.end_block == req.num_cached_blocks
    assert list(req.block_ids[:req.num_cached_blocks]) == path_ids, \
        f"{req.request_id}: block table prefix is not its cached path"
    assert req.num_cached_blocks * state.block_size <= req.num_computed_tokens or req.is_in_flight


def _check_handoff(state: SchedulerState, req: Request) -> None:
    """Between a prefill and a decode worker: on no worker and in no queue, holding blocks
    (in its current pool) for every computed token, with a token left to compute."""
    rid = req.request_id
    handoff = state.handoffs.get(rid)
    assert handoff is not None and handoff.req is req, f"{rid}: handed off but not in the table"
    assert req.queue_entry is None and req.worker_id == -1, f"{rid}: handed off but placed"
    assert not any(rid in w.running for w in state.workers.values()), f"{rid}: on a worker"
    assert req.num_computed_tokens == req.num_tokens - 1 - req.num_jumped, \
        f"{rid}: handed off mid-prompt"
    assert all(state.pool.pool_of(b) == req.pool_id for b in req.block_ids), f"{rid}: wrong pool"
    assert len(req.block_ids) >= state.kv.num_blocks_for(req.num_computed_tokens)
    expected_pool = handoff.dst_pool_id if handoff.is_copied else handoff.src_pool_id
    assert req.pool_id == expected_pool, f"{rid}: blocks in pool {req.pool_id}, not {expected_pool}"
    if handoff.is_copy_in_flight:
        assert state.handoffs.copies.get(handoff.copy_id) is handoff and req.is_in_flight
        assert len(handoff.dst_block_ids) == handoff.num_blocks
    _check_cached_path(state, req)
