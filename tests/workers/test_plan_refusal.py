"""Corrupted plans sent to a real worker process (this test plays the scheduler on the
workers socket): a block id past the pool, a key count past the block table, a table longer
than the pool, a token past the vocabulary, and columns of the wrong lengths (a plan that
does not even decode) are each refused - a StepResult for that step whose error says why -
nothing is computed or written, and the worker keeps serving: the request it was computing
goes on with the tokens a request that never met a bad plan gets."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from justapi.config.serve import build_config
from justapi.launch.child import ChildSpec, Endpoints
from justapi.launch.shm_pool import PoolSegments, plan_cpu_pool
from justapi.model.gguf_file import GGUFFile
from justapi.model.info import ModelInfo, resolve_model
from justapi.sampling import SamplingParams
from justapi.wire import transport
from justapi.wire.codec import encode
from justapi.wire.ids import worker_identity
from justapi.wire.protocol import NewRequest, Ready, Shutdown, StepPlan, StepResult
from tools.harness import TINY_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
POOL_BLOCKS = 32
BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PROMPT = [5, 9, 2, 7, 11, 3, 8]


class FakeScheduler:
    """The workers socket's scheduler end, and the launcher's control socket."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.context = zmq.Context()
        self.router = transport.make_socket(self.context, zmq.ROUTER, endpoints.workers, bind=True)
        self.control = transport.make_socket(self.context, zmq.PULL, endpoints.control, bind=True)

    def wait_ready(self, proc: subprocess.Popen) -> Ready:
        while True:
            assert proc.poll() is None, "the worker exited while starting"
            if self.router.poll(1000):
                _, message = transport.recv(self.router, routed=True)
                if isinstance(message, Ready):
                    return message

    def send_frames(self, frames: list) -> None:
        self.router.send_multipart([worker_identity(0), *frames])

    def step(self, plan: StepPlan) -> StepResult:
        self.send_frames(encode(plan))
        while True:
            assert self.router.poll(60_000), f"no answer to step {plan.step_id}"
            _, message = transport.recv(self.router, routed=True)
            if isinstance(message, StepResult):
                assert message.step_id == plan.step_id
                return message

    def close(self) -> None:
        self.router.close(0)
        self.control.close(0)
        self.context.term()


def _unchecked_plan(**fields: object) -> StepPlan:
    """A StepPlan that skips its own checks (as a corrupted message would arrive)."""
    plan = object.__new__(StepPlan)
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING
                else f.default for f in dataclasses.fields(StepPlan)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    for name, value in {**defaults, **fields}.items():
        object.__setattr__(plan, name, value)
    return plan


def _decode_step(step_id: int, rid: str, position: int, token: int, first_block: int) -> StepPlan:
    return StepPlan.build(step_id, [(rid, position, [token], [first_block], True)])


@pytest.fixture
def worker(tmp_path):
    model_path = resolve_model(TINY_MODEL)
    config = build_config({}, {"model": model_path, "pool_blocks": POOL_BLOCKS, "block_size": BS})
    info = ModelInfo.from_gguf(GGUFFile(model_path))
    segments = PoolSegments.create(plan_cpu_pool(info, config.cache, config.scheduler), config.pd)
    endpoints = Endpoints.in_dir(str(tmp_path))
    fake = FakeScheduler(endpoints)
    spec = ChildSpec("worker", 0, config, endpoints, model_path, pool=segments.for_worker(0))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "workers.process", spec.to_json()], cwd=ROOT,
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        ready = fake.wait_ready(proc)
        yield fake, ready, proc
    finally:
        fake.send_frames(encode(Shutdown("test over")))
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        fake.close()
        segments.unlink()


def test_corrupted_plans_are_refused_and_the_worker_keeps_serving(worker):
    fake, ready, proc = worker
    vocab = ready.vocab_size
    news = [NewRequest(rid, GREEDY, len(PROMPT), np.asarray(PROMPT, np.int32)) for rid in ("a", "b")]
    first = fake.step(StepPlan.build(1, [("a", 0, PROMPT, [0], True), ("b", 0, PROMPT, [8], True)],
                                     news))
    assert not first.error
    a_tokens = b_tokens = [int(first.sampled_token_ids[0])]
    assert int(first.sampled_token_ids[1]) == a_tokens[0]
    n = len(PROMPT)
    bad_plans = {
        "block id past the pool": _decode_step(10, "a", n, a_tokens[-1], POOL_BLOCKS),
        "key count past the table": StepPlan.build(11, [("a", 20, [a_tokens[-1]], [0], True)]),
        "table longer than the pool": StepPlan.build(12, [("a", n, [a_tokens[-1]],
                                                           [0] * (POOL_BLOCKS + 1), True)]),
        "token past the vocabulary": _decode_step(13, "a", n, vocab, 0),
        "wrong row counts": _unchecked_plan(
            step_id=14, request_ids=["a"], start_positions=np.asarray([n, n], np.int32),
            num_tokens=np.asarray([1, 1], np.int32), token_ids=np.asarray([a_tokens[-1]] * 2, np.int32),
            num_blocks=np.asarray([1], np.int32), block_ids=np.asarray([0], np.int32),
            sample_flags=np.asarray([True], np.bool_)),
    }
    reasons = {}
    for name, plan in bad_plans.items():
        result = fake.step(plan)
        assert result.error.startswith("refused: "), (name, result.error)
        assert result.request_ids == [] and proc.poll() is None
        reasons[name] = result.error
    assert "block id 32 is outside the pool's [0, 32)" in reasons["block id past the pool"]
    assert "its block table of 1 blocks covers 16" in reasons["key count past the table"]
    assert "more than the pool's 32" in reasons["table longer than the pool"]
    assert f"token id {vocab} is outside the vocabulary" in reasons["token past the vocabulary"]
    assert "StepPlan.start_positions has 2 entries, expected 1" in reasons["wrong row counts"]
    for i in range(6):  # both go on: "a" met every bad plan, "b" none
        position = n + i
        result = fake.step(StepPlan.build(20 + i, [("a", position, [a_tokens[-1]], [0], True),
                                                   ("b", position, [b_tokens[-1]], [8], True)]))
        assert not result.error
        a_tokens = a_tokens + [int(result.sampled_token_ids[0])]
        b_tokens = b_tokens + [int(result.sampled_token_ids[1])]
    assert a_tokens == b_tokens
    assert proc.poll() is None
