"""The admin messages (and the health fields of Heartbeat / SchedulerStats) round-trip
through the codec; a malformed admin message is refused."""
from __future__ import annotations

import orjson
import pytest

from justapi.wire.codec import ProtocolError, decode, encode
from justapi.wire.protocol import (
    AdminReply,
    CheckInvariants,
    DrainWorker,
    FlushPrefixCache,
    Heartbeat,
    QueryStatus,
    SchedulerStats,
    StatusReply,
)


def roundtrip(message):
    return decode([bytes(f) for f in encode(message)])


WORKER_ROW = {"worker_id": 0, "pool_id": 0, "pid": 1234, "device": "cuda:0", "healthy": True,
              "reason": "", "draining": False, "heartbeat_age_s": 0.2, "rss_bytes": 1 << 30,
              "gpu_temperature_c": 71.0, "gpu_throttle_reasons": ["sw_power_cap"],
              "gpu_xids": [79]}


@pytest.mark.parametrize("message", [
    QueryStatus(),
    DrainWorker(worker_id=3),
    DrainWorker(worker_id=0, is_draining=False),
    FlushPrefixCache(),
    FlushPrefixCache(pool_id=2),
    CheckInvariants(),
    AdminReply(ok=True, message="worker 1: draining (2 requests still running)",
               figures={"num_requests_running": 2}),
    AdminReply(ok=False, message="unknown worker 9 (workers: [0, 1])"),
    StatusReply(time_s=1.5, uptime_s=20.0, healthy=False, problems=["pool 0 has no healthy worker"],
                warnings=["worker 1 draining"], stats={"kv_usage": 0.25, "num_requests_waiting": 3},
                workers=[WORKER_ROW], gpus=[{"index": 0, "temperature_c": 71.0}], nvml="ok"),
    Heartbeat(worker_id=1, time_s=2.0, rss_bytes=10, cpu_time_s=0.5, gpu={},
              pool={"kind": "shm", "handle": "justapi-kv-1", "num_blocks": 64,
                    "num_bytes": 1 << 20, "is_mapped": True, "is_linked": True}),
    SchedulerStats(time_s=1.0, healthy=True, stats={}, workers=[WORKER_ROW],
                   warnings=["worker 0 unhealthy: no heartbeat for 1.6s"]),
])
def test_admin_messages_round_trip(message):
    assert roundtrip(message) == message


def test_old_heartbeats_and_stats_still_decode():
    """Fields added for health have defaults: a sender that does not know them still works."""
    beat = decode([orjson.dumps({"__type__": "Heartbeat", "worker_id": 0, "time_s": 1.0})])
    assert beat.pool == {} and beat.gpu == {}
    stats = decode([orjson.dumps({"__type__": "SchedulerStats", "time_s": 1.0, "healthy": True,
                                  "stats": {}, "workers": []})])
    assert stats.warnings == [] and stats.problems == []


def test_malformed_admin_messages_are_refused():
    with pytest.raises(ProtocolError, match="has no field 'command'"):
        decode([orjson.dumps({"__type__": "DrainWorker", "worker_id": 1, "command": "rm -rf"})])
    with pytest.raises(ProtocolError, match="bad DrainWorker"):
        decode([orjson.dumps({"__type__": "DrainWorker"})])
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode([orjson.dumps({"__type__": "Exec", "code": "print(1)"})])
