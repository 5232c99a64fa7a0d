"""A worker taken over by a restarted scheduler: the dead scheduler's plans and copy orders
still queued before the AttachWorker are dropped, never run; everything else stays in order."""
from __future__ import annotations

import numpy as np

from justapi.wire.protocol import AttachWorker, CopyBlocks, Shutdown, StepPlan
from workers.process import without_stale_orders


def _plan(step_id: int) -> StepPlan:
    return StepPlan.build(step_id, [("a", 0, [1, 2, 3], [4], True)])


def test_orders_before_an_attach_are_dropped() -> None:
    copy = CopyBlocks(copy_id=1, src_pool=0, src_block_ids=np.asarray([1], np.int32),
                      dst_block_ids=np.asarray([2], np.int32))
    stale, fresh, attach, stop = _plan(7), _plan(1), AttachWorker(42), Shutdown("x")
    assert without_stale_orders([stale, copy, stop, attach, fresh]) == [stop, attach, fresh]
    second = AttachWorker(43)
    assert without_stale_orders([stale, attach, fresh, second]) == [attach, second]


def test_without_an_attach_nothing_is_dropped() -> None:
    messages = [_plan(1), _plan(2), Shutdown("x")]
    assert without_stale_orders(messages) == messages
