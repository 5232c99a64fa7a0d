"""Admin commands over a real scheduler core: status, drain/undrain, flush, invariant check,
errors naming the bad value; and the admin socket + AdminClient over real ZMQ sockets."""
from __future__ import annotations

import os
import threading

import zmq

from justapi.config.ops import OpsConfig
from justapi.health.watch import HealthWatch
from justapi.ops.admin_client import AdminClient
from justapi.scheduler.admin import AdminServer, handle_admin
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire.protocol import (
    AdminReply,
    CheckInvariants,
    DrainWorker,
    FlushPrefixCache,
    Heartbeat,
    PoolInfo,
    QueryStatus,
    Ready,
    StatusReply,
)


def setup(num_workers: int = 2) -> tuple[Harness, HealthWatch]:
    h = Harness(build_scheduler(pool_blocks=64, num_workers=num_workers))
    watch = HealthWatch(OpsConfig(), launcher_pid=os.getpid(),
                        gpu_opener=lambda indices: (None, "not needed (CPU workers)"))
    for worker_id in range(num_workers):
        watch.on_ready(Ready(worker_id, 0, "m", 64, 1024,
                             PoolInfo(0, "shm", "", "cpu", "float32", 2, 64, 4, 1, 8)))
        watch.on_heartbeat(Heartbeat(worker_id, 0.0, rss_bytes=123))
    watch.poll()
    return h, watch


def test_status_has_workers_queues_and_cache_figures():
    h, watch = setup()
    h.submit("a", list(range(3, 20)), max_tokens=4, ignore_eos=True)
    h.run()
    h.submit("b", list(range(3, 20)), max_tokens=4, ignore_eos=True)
    reply = handle_admin(h.scheduler, watch, QueryStatus())
    assert isinstance(reply, StatusReply) and reply.healthy and reply.problems == []
    assert [w["worker_id"] for w in reply.workers] == [0, 1]
    assert reply.workers[0]["rss_bytes"] == 123 and reply.workers[0]["draining"] is False
    assert reply.stats["num_requests_waiting"] == 1 and reply.stats["prefix_cache_blocks"] == 5
    assert reply.nvml == "not needed (CPU workers)" and reply.uptime_s >= 0


def test_drain_and_undrain():
    h, watch = setup()
    h.submit("a", [3, 4, 5, 6], max_tokens=8, ignore_eos=True)
    h.step()
    busy = 0 if h.scheduler.stats()["worker_0_num_requests_running"] else 1
    reply = handle_admin(h.scheduler, watch, DrainWorker(busy))
    assert reply == AdminReply(True, f"worker {busy}: draining (1 request(s) running)",
                               {"worker_id": busy, "is_draining": True, "num_requests_running": 1})
    status = handle_admin(h.scheduler, watch, QueryStatus())
    assert status.warnings == [f"worker {busy} is draining"] and status.healthy
    h.run()
    reply = handle_admin(h.scheduler, watch, DrainWorker(busy, is_draining=False))
    assert reply.ok and reply.message == f"worker {busy}: accepting new requests (0 request(s) running)"


def test_flush_and_invariants():
    h, watch = setup()
    h.submit("a", list(range(3, 20)), max_tokens=2, ignore_eos=True)
    h.run()
    reply = handle_admin(h.scheduler, watch, FlushPrefixCache())
    assert reply.ok and reply.figures == {"num_blocks_freed": 4, "prefix_cache_blocks": 0}
    check = handle_admin(h.scheduler, watch, CheckInvariants())
    assert check.ok and check.message == "invariants hold (64 blocks, 0 running, 0 waiting)"
    h.scheduler.state.pool.allocate(0, 1, "ghost")  # a leaked block: held by no request
    broken = handle_admin(h.scheduler, watch, CheckInvariants())
    assert not broken.ok and broken.message.startswith("invariant violated: block ")
    assert "'ghost'" in broken.message


def test_bad_input_is_an_error_reply_naming_the_value():
    h, watch = setup()
    assert handle_admin(h.scheduler, watch, DrainWorker(9)) == AdminReply(
        False, "unknown worker 9 (workers: [0, 1])")
    assert handle_admin(h.scheduler, watch, FlushPrefixCache(pool_id=4)) == AdminReply(
        False, "unknown pool 4 (pools: [0])")
    assert handle_admin(h.scheduler, watch, FlushPrefixCache(pool_id=-7)).message == \
        "pool_id must be -1 (every pool) or a pool id, got -7"
    assert handle_admin(h.scheduler, watch, Heartbeat(0, 0.0)).message == \
        "unknown admin command Heartbeat"


def test_admin_socket_round_trip(tmp_path):
    h, watch = setup()
    context = zmq.Context()
    server = AdminServer(context, f"ipc://{tmp_path}/admin.sock")
    stop = threading.Event()

    def serve() -> None:  # the scheduler loop's part, on a thread for this test
        while not stop.is_set():
            if server.socket.poll(20):
                server.serve(h.scheduler, watch)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with AdminClient(server.endpoint, timeout_s=5) as client:
            assert client.status().healthy
            assert client.drain(1).figures["is_draining"] is True
            assert client.flush_prefix_cache().ok
            assert client.check_invariants().ok
            assert not client.drain(5).ok
    finally:
        stop.set()
        thread.join()
        server.close()
        context.term()
