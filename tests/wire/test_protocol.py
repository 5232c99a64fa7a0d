"""Every wire message round-trips through the codec; malformed frames are refused, never executed."""
from __future__ import annotations

import pickle

import numpy as np
import orjson
import pytest

from justapi.sampling import SamplingParams
from justapi.wire.codec import PACK_ALIGN, PACK_LIMIT, ProtocolError, decode, encode
from justapi.wire.protocol import (
    AbortRequest,
    AttachWorker,
    BlockData,
    CopyBlocks,
    Heartbeat,
    NewRequest,
    PoolInfo,
    ProcessFailed,
    ProcessReady,
    Ready,
    SchedulerStarted,
    SchedulerStats,
    Shutdown,
    StepPlan,
    StepResult,
    SubmitRequest,
    TokenDeltas,
    offsets,
)


def _i32(values):
    return np.asarray(values, dtype=np.int32)


def roundtrip(message):
    frames = [bytes(f) for f in encode(message)]
    return decode(frames)


def assert_same(a, b):
    assert type(a) is type(b)
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
        elif isinstance(x, list) and x and hasattr(x[0], "__dataclass_fields__"):
            for u, v in zip(x, y, strict=True):
                assert_same(u, v)
        else:
            assert x == y, name


SAMPLING = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3,
                          stop_token_ids=(2, 5), logprobs=2, logit_bias={7: -100.0, 3: 1.5})
POOL = PoolInfo(pool_id=0, kind="shm", handle="justapi-kv-1", device="cpu", dtype="float32",
                num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=8)

MESSAGES = [
    StepPlan.build(9, [("a", 0, [1, 2, 3], [4], True), ("b", 17, [7], [1, 2], True)],
                   new_requests=[NewRequest("a", SAMPLING, 3, _i32([1, 2, 3]))],
                   finished_request_ids=["z"]),
    StepResult(step_id=9, worker_id=1, request_ids=["a", "b"], num_sampled=_i32([1, 2]),
               sampled_token_ids=_i32([5, 6, 7]), logprobs=np.zeros(3, np.float32),
               top_logprob_ids=np.full((3, 2), -1, np.int32),
               top_logprobs=np.zeros((3, 2), np.float32), step_time_s=0.0625),
    CopyBlocks(copy_id=1, src_pool=0, src_block_ids=_i32([1, 2]), dst_block_ids=_i32([3, 4])),
    Shutdown("bye"),
    Ready(worker_id=0, pid=123, model_name="m", vocab_size=100, max_context=64, pool=POOL),
    Heartbeat(worker_id=0, time_s=1.5, rss_bytes=10, cpu_time_s=0.5, gpu={"temp_c": 40}),
    SubmitRequest("r1", _i32([1, 2, 3]), SAMPLING, arrival_time_s=1.0, priority=2, cache_salt="m"),
    SubmitRequest("r2", _i32([1, 2]), SAMPLING, output_token_ids=_i32([9, 8, 7])),
    AttachWorker(scheduler_pid=4321),
    SchedulerStarted(pid=4321, num_restarts=2),
    AbortRequest(["r1", "r2"]),
    TokenDeltas(step_id=3, request_ids=["r1", "r2"], num_new_tokens=_i32([2, 0]),
                token_ids=_i32([4, 5]), finish_reasons=["", "abort"],
                num_cached_tokens=_i32([16, 0]), errors={"r2": "x"}),
    SchedulerStats(time_s=1.0, healthy=True, stats={"num_requests_running": 1},
                   workers=[{"worker_id": 0}], problems=[]),
    ProcessReady("worker", 1, 77, {"pool_blocks": 3}),
    ProcessFailed("worker", 1, 77, "boom"),
    SAMPLING,
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_roundtrip(message):
    assert_same(message, roundtrip(message))


def test_arrays_travel_as_raw_bytes_not_json():
    plan = MESSAGES[0]
    frames = encode(plan)
    header = orjson.loads(bytes(frames[0]))
    assert header["token_ids"]["dtype"] == "<i4"
    assert b"[1,2,3" not in bytes(frames[0])
    # small arrays share one frame, each at an aligned offset, in field order
    assert len(frames) == 2
    refs = [header[name] for name in ("start_positions", "num_tokens", "token_ids", "block_ids")]
    assert all(ref["__frame__"] == 1 and ref["offset"] % PACK_ALIGN == 0 for ref in refs)
    assert [ref["offset"] for ref in refs] == sorted(ref["offset"] for ref in refs)
    start = header["token_ids"]["offset"]
    assert bytes(frames[1])[start:start + 12] == plan.token_ids[:3].tobytes()
    # fields left at their empty-array default are not sent; the receiver fills them in
    assert "draft_parents" not in header and "token_bitmask" not in header
    assert roundtrip(plan).token_bitmask.shape == plan.token_bitmask.shape


def test_a_large_array_keeps_a_frame_of_its_own_without_a_copy():
    data = np.arange(PACK_LIMIT + 1, dtype=np.uint8)
    message = BlockData(copy_id=1, worker_id=0, first=0, num_blocks=1, dtype="float32", data=data,
                        is_last=True)
    frames = encode(message)
    assert len(frames) == 2 and "offset" not in orjson.loads(bytes(frames[0]))["data"]
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), data)
    assert np.array_equal(roundtrip(message).data, data)


def _packed(offsets_and_bytes):
    """A StepResult whose two arrays sit at the given offsets of a shared frame of n bytes."""
    (first, second), size = offsets_and_bytes
    header = {"__type__": "StepResult", "step_id": 1, "worker_id": 0, "request_ids": ["a"],
              "num_sampled": {"__frame__": 1, "offset": first, "dtype": "<i4", "shape": [1]},
              "sampled_token_ids": {"__frame__": 1, "offset": second, "dtype": "<i4", "shape": [1]}}
    return [orjson.dumps(header), np.ones(size // 4, np.int32).tobytes()]


def test_packed_arrays_must_not_overlap_overrun_or_leave_bytes():
    assert decode(_packed(((0, 16), 20))).sampled_token_ids.tolist() == [1]
    for bad, match in ((((0, 0), 8), "overlap"), (((16, 0), 20), "overlap"), (((0, 4), 4), "needs 8"),
                       (((0, 16), 24), "end at 20"), (((0, -4), 20), "offset")):
        with pytest.raises(ProtocolError, match=match):
            decode(_packed(bad))


def test_offsets():
    assert offsets(_i32([2, 0, 3])).tolist() == [0, 2, 2, 5]


@pytest.mark.parametrize("frames", [
    [],
    [b"not json"],
    [b"[1,2]"],
    [orjson.dumps({"__type__": "NoSuchType"})],
    [orjson.dumps({"__type__": "AbortRequest", "request_ids": ["a"], "evil": 1})],
    [orjson.dumps({"__type__": "AbortRequest"})],
    [pickle.dumps({"__type__": "AbortRequest", "request_ids": ["a"]})],
])
def test_malformed_is_refused(frames):
    with pytest.raises(ProtocolError):
        decode(frames)


def _plan_frames():
    return [bytes(f) for f in encode(MESSAGES[0])]


def test_truncated_array_frame_is_refused():
    frames = _plan_frames()
    frames[1] = frames[1][:-1]  # the shared frame: its last array runs past the end
    with pytest.raises(ProtocolError, match="bytes"):
        decode(frames)


def test_disallowed_dtype_and_extra_frames_are_refused():
    frames = _plan_frames()
    header = orjson.loads(frames[0])
    header["token_ids"]["dtype"] = "|O"
    with pytest.raises(ProtocolError, match="dtype"):
        decode([orjson.dumps(header), *frames[1:]])
    with pytest.raises(ProtocolError, match="frames"):
        decode([*frames, b"extra"])


def test_inconsistent_plan_is_refused():
    frames = _plan_frames()
    header = orjson.loads(frames[0])
    header["request_ids"] = ["only-one"]
    with pytest.raises(ProtocolError, match="StepPlan"):
        decode([orjson.dumps(header), *frames[1:]])


def test_bad_sampling_params_inside_a_message_are_refused():
    frames = [bytes(f) for f in encode(MESSAGES[6])]
    header = orjson.loads(frames[0])
    header["sampling"]["temperature"] = -1
    with pytest.raises(ProtocolError, match="temperature"):
        decode([orjson.dumps(header), *frames[1:]])
