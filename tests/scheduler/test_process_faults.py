"""The scheduler process survives what one request or one worker message brings (over real
ZMQ sockets, fake workers: tests/health/test_scheduler_shell_health.py's Shell): a submit the
core fails on, a request that fails while planned and a result for a step nobody sent are each
kept to that request or dropped - the other requests finish, and the failures are counted by
stage in the stats the frontend reads."""
from __future__ import annotations

import numpy as np
import pytest

from justapi.scheduler.planner import StepPlanner
from justapi.scheduler.scheduler import Scheduler
from justapi.wire import transport
from justapi.wire.protocol import FINISH_ERROR, FINISH_LENGTH, StepResult
from tests.health.test_scheduler_shell_health import Shell

pytestmark = pytest.mark.timeout(120)


class Boom(RuntimeError):
    pass


@pytest.fixture
def shell(tmp_path, monkeypatch):
    add_request, schedule_decode = Scheduler.add_request, StepPlanner._schedule_decode

    def add(self, request):
        if request.request_id == "bad-submit":
            raise Boom("injected into add_request")
        return add_request(self, request)

    def decode(self, req, batch):
        if req.request_id == "bad-plan" and req.num_output_tokens >= 2:
            raise Boom("injected into planning")
        return schedule_decode(self, req, batch)
    monkeypatch.setattr(Scheduler, "add_request", add)
    monkeypatch.setattr(StepPlanner, "_schedule_decode", decode)
    made = Shell(tmp_path, 1)
    yield made
    made.close()


def test_one_requests_failure_and_bad_worker_messages_leave_the_rest_serving(shell) -> None:
    (worker,) = shell.workers
    shell.submit("a", max_tokens=6)
    shell.submit("bad-submit", max_tokens=6)
    shell.submit("bad-plan", max_tokens=6)
    shell.pump_until(lambda: len(worker.plans) >= 2)
    # a result for a step nobody sent, from the worker's own socket (the core refuses it)
    transport.send(worker.sock, StepResult(987, 0, ["a"], np.ones(1, np.int32),
                                           np.full(1, 7, np.int32)))
    shell.submit("b", max_tokens=6)
    shell.pump_until(lambda: all(shell.finish_reason(r) for r in ("a", "b", "bad-submit", "bad-plan")))
    assert shell.finish_reason("a") == shell.finish_reason("b") == FINISH_LENGTH
    assert shell.finish_reason("bad-submit") == shell.finish_reason("bad-plan") == FINISH_ERROR
    assert shell.error("bad-submit") == "admit failed: Boom: injected into add_request"
    assert shell.error("bad-plan") == "plan failed: Boom: injected into planning"
    assert shell.thread.is_alive()
    shell.pump_until(lambda: shell.stats is not None
                     and shell.stats.stats.get("request_failures_plan") == 1)
    stats = shell.stats.stats
    assert (stats["request_failures_admit"], stats["request_failures_mask"],
            stats["request_failures_results"]) == (1, 0, 0)
    assert stats["kv_blocks_in_use"] == 0
