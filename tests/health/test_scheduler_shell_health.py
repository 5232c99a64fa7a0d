"""The scheduler process's health wiring over real ZMQ sockets, with fake workers (no torch):
a worker whose step hangs while its heartbeat still beats is retired and its request finishes
on the other worker; a silent worker is retired; the last one gone fails requests clearly."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from justapi.config.serve import build_config
from justapi.launch.child import ChildSpec, Endpoints, StopFlag
from justapi.sampling import SamplingParams
from justapi.scheduler.process import SchedulerProcess
from justapi.wire import transport
from justapi.wire.protocol import (
    FINISH_ERROR,
    FINISH_LENGTH,
    Heartbeat,
    PoolInfo,
    Ready,
    SchedulerStats,
    StepPlan,
    StepResult,
    SubmitRequest,
    TokenDeltas,
)

pytestmark = pytest.mark.timeout(120)


class FakeWorker:
    """Sends Ready, beats while `is_beating`, and answers plans while `is_answering`."""

    def __init__(self, context: zmq.Context, endpoint: str, worker_id: int) -> None:
        self.worker_id = worker_id
        self.sock = transport.make_socket(context, zmq.DEALER, endpoint, bind=False,
                                          identity=f"worker-{worker_id}".encode())
        self.beat = transport.make_socket(context, zmq.DEALER, endpoint, bind=False,
                                          identity=f"worker-{worker_id}-heartbeat".encode())
        self.is_beating = True
        self.is_answering = True
        self.plans: list[StepPlan] = []
        info = PoolInfo(0, "shm", "", "cpu", "float32", 2, 64, 16, 1, 8)
        transport.send(self.sock, Ready(worker_id, 0, "fake", 64, 1024, info))

    def tick(self) -> None:
        if self.is_beating:
            transport.send(self.beat, Heartbeat(self.worker_id, time.time()))
        for _, plan in transport.drain(self.sock):
            if not isinstance(plan, StepPlan):
                continue
            self.plans.append(plan)
            if self.is_answering:
                sampled = [r for r, s in zip(plan.request_ids, plan.sample_flags) if s]
                steps = plan.num_steps  # a token per request and step (multi-step plans)
                transport.send(self.sock, StepResult(
                    plan.step_id, self.worker_id, sampled, np.full(len(sampled), steps, np.int32),
                    np.full(len(sampled) * steps, 7, np.int32)))


class Shell:
    """A SchedulerProcess on a thread, a frontend socket, and fake workers ticking."""

    def __init__(self, tmp_path, num_workers: int, **ops: object) -> None:
        config = build_config({"workers": num_workers, "block-size": 16, **ops}, {})
        endpoints = Endpoints.in_dir(str(tmp_path))
        spec = ChildSpec("scheduler", 0, config, endpoints, "fake.gguf",
                         extra={"num_workers": num_workers, "eos_token_ids": [],
                                "long_rope_context": 0})  # (no model file to read them from)
        self.context = zmq.Context()
        self.frontend = transport.make_socket(self.context, zmq.PULL, endpoints.frontend_in,
                                              bind=True)
        self.stop = StopFlag()
        self.process = SchedulerProcess(spec, self.stop)
        self.to_scheduler = transport.make_socket(self.context, zmq.PUSH, endpoints.scheduler_in,
                                                  bind=False)
        self.workers = [FakeWorker(self.context, endpoints.workers, i) for i in range(num_workers)]
        self.process.wait_for_workers(10)
        self.thread = threading.Thread(target=self.process.run)
        self.thread.start()
        self.deltas: list[TokenDeltas] = []
        self.stats: SchedulerStats | None = None

    def submit(self, request_id: str, max_tokens: int) -> None:
        transport.send(self.to_scheduler, SubmitRequest(
            request_id, np.arange(3, 20, dtype=np.int32),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    def pump_until(self, predicate, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            for worker in self.workers:
                worker.tick()
            for _, message in transport.drain(self.frontend):
                if isinstance(message, TokenDeltas):
                    self.deltas.append(message)
                elif isinstance(message, SchedulerStats):
                    self.stats = message
            time.sleep(0.05)

    def finish_reason(self, request_id: str) -> str:
        for deltas in self.deltas:
            for rid, reason in zip(deltas.request_ids, deltas.finish_reasons):
                if rid == request_id and reason:
                    return reason
        return ""

    def error(self, request_id: str) -> str:
        return next((d.errors[request_id] for d in self.deltas if request_id in d.errors), "")

    def row(self, worker_id: int) -> dict:
        assert self.stats is not None
        return next(w for w in self.stats.workers if w["worker_id"] == worker_id)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.process.close()
        self.context.destroy(0)


@pytest.fixture
def make_shell(tmp_path):
    shells = []

    def make(num_workers: int, **ops: object) -> Shell:
        shells.append(Shell(tmp_path, num_workers, **ops))
        return shells[-1]

    yield make
    for shell in shells:
        shell.close()


def test_a_hung_step_is_retired_and_its_request_finishes_elsewhere(make_shell):
    shell = make_shell(2, **{"step-timeout-s": 1.0})
    hung, good = shell.workers
    hung.is_answering = False  # its heartbeat still beats
    shell.submit("a", max_tokens=5)
    shell.submit("b", max_tokens=5)
    shell.pump_until(lambda: hung.plans)
    shell.pump_until(lambda: shell.finish_reason("a") and shell.finish_reason("b"))
    assert shell.finish_reason("a") == shell.finish_reason("b") == FINISH_LENGTH
    shell.pump_until(lambda: shell.stats is not None and not shell.row(0)["healthy"])
    assert shell.row(0)["reason"].startswith(f"step {hung.plans[0].step_id} in flight for ")
    assert "(hung; its heartbeat still beats)" in shell.row(0)["reason"]
    assert shell.stats.healthy and shell.stats.warnings[0].startswith("worker 0 unhealthy: step")


def test_a_silent_worker_is_retired_and_the_last_one_fails_requests(make_shell):
    shell = make_shell(1)
    (worker,) = shell.workers
    shell.submit("a", max_tokens=200)
    shell.pump_until(lambda: len(worker.plans) >= 3)
    worker.is_beating = worker.is_answering = False
    shell.pump_until(lambda: shell.finish_reason("a"))
    assert shell.finish_reason("a") == FINISH_ERROR
    assert shell.error("a") == "no healthy worker can serve 'a'"
    shell.pump_until(lambda: shell.stats is not None and not shell.stats.healthy)
    assert shell.row(0)["reason"].startswith("no heartbeat for ")
    assert shell.stats.problems == ["pool 0 has no healthy worker"]
    shell.submit("late", max_tokens=2)
    shell.pump_until(lambda: shell.finish_reason("late"))
    assert shell.error("late") == "request 'late': no healthy worker"
