"""Hostile ZeroMQ input to every socket of a live pool: malformed frames, wrong types,
truncated numpy buffers, object dtypes, forged results, and pickles whose __reduce__ would
create a marker file. Each is rejected and logged, nothing is unpickled or executed, and
every process is alive and serving afterwards with its scheduler invariants intact."""
from __future__ import annotations

import os
import pickle
import signal
import time

import httpx
import orjson
import pytest
import zmq

from justapi.ops.admin_client import AdminClient
from justapi.sampling import SamplingParams
from justapi.wire.codec import encode
from justapi.wire.protocol import (
    AbortRequest,
    DrainWorker,
    FlushPrefixCache,
    ProcessFailed,
    StepResult,
    SubmitRequest,
)
from tools.harness import TINY_MODEL, ServedPool, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SOCKETS = {  # runtime-dir socket -> the socket type a peer of it uses
    "client": zmq.DEALER, "scheduler": zmq.PUSH, "workers": zmq.DEALER, "admin": zmq.DEALER,
    "frontend": zmq.PUSH, "control": zmq.PUSH}


class Boom:
    """Unpickling this runs `touch MARKER` - if anything ever unpickles it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def header(payload: object) -> bytes:
    return orjson.dumps(payload)


def hostile_messages(marker: str) -> list[list[bytes]]:
    evil = pickle.dumps(Boom(marker))
    sampling = {"__type__": "SamplingParams", "max_tokens": 4}
    int_frame = {"__frame__": 1, "dtype": "<i4", "shape": [8]}
    messages = [
        [evil],                                                   # a bare pickle
        [pickle.dumps({"__type__": "SubmitRequest"})],            # pickled "header"
        [header({"__type__": "SubmitRequest", "request_id": "p", "sampling": sampling,
                 "prompt_token_ids": {"__frame__": 1, "dtype": "|O", "shape": [1]}}), evil],
        [b""], [b"\x00" * 64], [os.urandom(512)], [b"{}"], [b"[1, 2, 3]"], [b'"str"'],
        [header({"__type__": "NoSuchMessage"})],
        [header({"__type__": ["SubmitRequest"]})],
        [header({"__type__": "SubmitRequest", "request_id": 7, "sampling": sampling,
                 "prompt_token_ids": int_frame}), b"\x01" * 32],          # id of wrong type
        [header({"__type__": "SubmitRequest", "request_id": "w", "sampling": 5,
                 "prompt_token_ids": int_frame}), b"\x01" * 32],           # sampling not params
        [header({"__type__": "SubmitRequest", "request_id": "s", "sampling": sampling,
                 "prompt_token_ids": "1 2 3"})],                           # ids as a string
        [header({"__type__": "SubmitRequest", "request_id": "t", "sampling": sampling,
                 "prompt_token_ids": int_frame}), b"\x01" * 10],           # truncated buffer
        [header({"__type__": "SubmitRequest", "request_id": "h", "sampling": sampling,
                 "prompt_token_ids": {"__frame__": 1, "dtype": "<i4", "shape": [2**40]}}),
         b"\x01" * 8],                                                     # absurd shape
        [header({"__type__": "SubmitRequest", "request_id": "n", "sampling": sampling,
                 "prompt_token_ids": {"__frame__": 1, "dtype": "<i4", "shape": [-1]}}), b""],
        [header({"__type__": "SubmitRequest", "request_id": "x", "sampling": sampling,
                 "prompt_token_ids": int_frame, "extra_field": 1}), b"\x01" * 32],
        [header({"__type__": "SubmitRequest", "request_id": "m", "sampling": {
            "__type__": "SamplingParams", "max_tokens": -5}, "prompt_token_ids": int_frame}),
         b"\x01" * 32],                                                    # bad sampling value
        [header({"__type__": "AbortRequest", "request_ids": [1, 2]})],
        [header({"__type__": "DrainWorker", "worker_id": "0"})],
        [header({"__type__": "Shutdown", "reason": [[[[[[[[[[[[]]]]]]]]]]]]})],  # deep nesting
        [header({"__type__": "StepResult", "step_id": 1, "worker_id": 0, "request_ids": ["a"],
                 "num_sampled": int_frame, "sampled_token_ids": int_frame}), b"\x00" * 32],
        encode(SubmitRequest("oov", _i32([10**6, 5]), SamplingParams(max_tokens=4))),
        encode(AbortRequest(["never-submitted"])),
        encode(StepResult(step_id=999, worker_id=0, request_ids=["forged"],
                          num_sampled=_i32([1]), sampled_token_ids=_i32([3]))),
        encode(DrainWorker(worker_id=42)), encode(FlushPrefixCache(pool_id=99)),
        encode(ProcessFailed("worker", 0, 1, "forged failure")),
    ]
    return messages + [m + [b"trailing frame"] for m in messages[-6:]]


def _i32(values: list[int]):
    import numpy as np
    return np.asarray(values, dtype=np.int32)


@pytest.fixture(scope="module")
def pool():
    served = ServedPool("--model", TINY_MODEL, "--pool-blocks", "128")
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []


def test_hostile_frames_to_every_socket_are_dropped_and_nothing_is_executed(pool, tmp_path):
    marker = str(tmp_path / "pwned")
    runtime_dir = pool.runtime_dir
    assert runtime_dir is not None
    context = zmq.Context()
    num_sent = 0
    try:
        for name, kind in SOCKETS.items():
            sock = context.socket(kind)
            sock.setsockopt(zmq.LINGER, 1000)
            if kind == zmq.DEALER:  # a fresh identity: never one of the workers'
                sock.setsockopt(zmq.IDENTITY, f"intruder-{name}".encode())
            sock.connect(f"ipc://{runtime_dir}/{name}.sock")
            for frames in hostile_messages(marker):
                sock.send_multipart(frames)
                num_sent += 1
            time.sleep(0.3)
            sock.close()
    finally:
        context.term()
    time.sleep(1.0)  # every process has read and dropped everything by now
    assert not os.path.exists(marker), "a pickle was executed"
    assert all(pid_alive(pid) for pid in pool.children), pool.log()
    assert pool.proc.poll() is None
    assert httpx.get(f"{pool.base_url}/health", timeout=10).status_code == 200
    response = httpx.post(f"{pool.base_url}/v1/completions", timeout=60, json={
        "prompt": "still serving", "max_tokens": 8, "ignore_eos": True, "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
    with AdminClient(pool_admin(pool), timeout_s=10) as admin:
        check = admin.check_invariants()
        assert check.ok, check.message
        assert not any(w["draining"] for w in admin.status().workers)
    log = pool.log()
    assert log.count("dropped malformed") >= 5 * len(SOCKETS), log
    assert "not that worker's socket" in log  # the forged StepResult
    assert "Traceback" not in log  # nothing raised past a handler (no step failed, no crash)
    print(f"sent {num_sent} hostile messages to {len(SOCKETS)} sockets; "
          f"{log.count('dropped malformed')} logged as malformed")


def pool_admin(pool: ServedPool) -> str:
    return f"ipc://{pool.runtime_dir}/admin.sock"
