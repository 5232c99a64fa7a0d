"""Pieces of the scale-out path without Ray, over real sockets and real KV pools: the worker
endpoint's CURVE + ZAP (authorized keys in, others refused, the file re-read), KV blocks
between two pools through the relay as codec frames (chunked, byte-exact), the relay's
failures (a lost source, out-of-order chunks, bad ids, a dtype mismatch), the scheduler's
links (which copies go through the relay, from which worker; fence orders to the launcher),
host-aware health (no /proc checks of other hosts' pids, fencing through the launcher, a lost
host), and the cluster config."""
from __future__ import annotations

import dataclasses
import logging
import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

from justapi.cluster.kv_relay import KvRelay, needs_relay
from justapi.cluster.links import ClusterLinks
from justapi.config.ops import OpsConfig
from justapi.config.sections import ConfigError
from justapi.config.serve import ServeConfig, build_config
from justapi.frontend.api_server import _health_details
from justapi.frontend.metrics import FrontendMetrics
from justapi.health.cluster import HostHealth
from justapi.health.watch import HealthWatch
from justapi.launch.child import ChildSpec, Endpoints
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire import codec, transport
from justapi.wire.auth import (
    bind_worker_socket,
    connect_worker_socket,
    read_authorized_keys,
    write_authorized_keys,
    write_secret_key,
)
from justapi.wire.protocol import (
    BlockData,
    CopyBlocks,
    FenceWorker,
    Heartbeat,
    PoolInfo,
    ReadBlocks,
    Ready,
    SchedulerStats,
    WriteBlocks,
)
from tools.harness import free_port
from workers.kv.pool import KVPool, PoolShape
from workers.kv.wire import BlockWriter, read_blocks

SHAPE = PoolShape(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


# ---------------------------------------------------------------------- CURVE and ZAP
@pytest.fixture
def endpoint(tmp_path):
    """A scheduler-side CURVE ROUTER on loopback with an (empty) authorized-keys file."""
    context = zmq.Context()
    public, secret = zmq.curve_keypair()
    keys = str(tmp_path / "workers.keys")
    write_authorized_keys(keys, {})
    address = f"tcp://127.0.0.1:{free_port()}"
    server, auth = bind_worker_socket(context, address, secret, keys)
    yield context, server, address, public, keys
    server.close(0)
    auth.stop()
    context.term()


def received(server: zmq.Socket, timeout_ms: int = 3000) -> list:
    if not server.poll(timeout_ms):
        return []
    return server.recv_multipart(copy=False)


def test_an_authorized_worker_gets_in_under_its_name(endpoint):
    context, server, address, server_public, keys = endpoint
    public, secret = zmq.curve_keypair()
    write_authorized_keys(keys, {"worker-3": public})
    client = connect_worker_socket(context, address, b"worker-3", secret, server_public)
    transport.send(client, Heartbeat(3, 1.0))
    frames = received(server)
    assert bytes(frames[0].buffer) == b"worker-3" and frames[1].get("User-Id") == "worker-3"
    assert isinstance(codec.decode(frames[1:]), Heartbeat)
    client.close(0)


def test_an_admitted_key_speaks_only_for_its_own_worker(endpoint, caplog):
    context, server, address, server_public, keys = endpoint
    public, secret = zmq.curve_keypair()
    write_authorized_keys(keys, {"worker-3": public})
    impostor = connect_worker_socket(context, address, b"worker-4", secret, server_public)
    beats = connect_worker_socket(context, address, b"worker-3-heartbeat", secret, server_public)
    with caplog.at_level(logging.WARNING, logger="justapi.wire.auth"):
        transport.send(impostor, Heartbeat(4, 1.0))
        time.sleep(0.5)
        transport.send(beats, Heartbeat(3, 2.0))
        frames = received(server)
    assert bytes(frames[0].buffer) == b"worker-3-heartbeat"  # worker-4's message was dropped
    assert codec.decode(frames[1:]).time_s == 2.0 and received(server, 300) == []
    assert "dropped a message from 'worker-4': its CURVE key was admitted as 'worker-3'" \
        in caplog.text
    impostor.close(0)
    beats.close(0)


def test_an_unknown_key_is_refused_and_logged(endpoint, caplog):
    context, server, address, server_public, keys = endpoint
    public, secret = zmq.curve_keypair()
    with caplog.at_level(logging.WARNING, logger="justapi.wire.auth"):
        client = connect_worker_socket(context, address, b"worker-0", secret, server_public)
        transport.send(client, Heartbeat(0, 1.0))
        assert received(server, 1500) == []
    assert "refused a worker connection" in caplog.text
    assert public[:8].decode() in caplog.text
    client.close(0)


def test_the_keys_file_is_read_again_when_it_changes(endpoint):
    context, server, address, server_public, keys = endpoint
    public, secret = zmq.curve_keypair()
    early = connect_worker_socket(context, address, b"worker-1", secret, server_public)
    transport.send(early, Heartbeat(1, 1.0))
    assert received(server, 1000) == []  # not yet authorized: refused (and not retried)
    early.close(0)
    time.sleep(0.01)  # a new mtime
    write_authorized_keys(keys, {"worker-1": public})
    late = connect_worker_socket(context, address, b"worker-1", secret, server_public)
    transport.send(late, Heartbeat(1, 2.0))
    assert received(server)[1].get("User-Id") == "worker-1"
    late.close(0)


def test_a_worker_trusting_another_server_key_or_no_curve_never_gets_through(endpoint):
    context, server, address, _, keys = endpoint
    public, secret = zmq.curve_keypair()
    write_authorized_keys(keys, {"worker-0": public})
    impostor_public, _ = zmq.curve_keypair()
    wrong = connect_worker_socket(context, address, b"worker-0", secret, impostor_public)
    plain = transport.make_socket(context, zmq.DEALER, address, bind=False, identity=b"worker-0")
    for sock in (wrong, plain):
        transport.send(sock, Heartbeat(0, 1.0))
    assert received(server, 1500) == []
    wrong.close(0)
    plain.close(0)


def test_key_files_are_private_and_parse(tmp_path):
    path = str(tmp_path / "server.key")
    _, secret = zmq.curve_keypair()
    write_secret_key(path, secret)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        write_secret_key(path, secret)
    keys = str(tmp_path / "workers.keys")
    public, _ = zmq.curve_keypair()
    write_authorized_keys(keys, {"worker-0": public})
    assert read_authorized_keys(keys) == {public: "worker-0"}
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o600
    assert read_authorized_keys(str(tmp_path / "missing")) == {}


# ---------------------------------------------------------------------- KV over the wire
def pool(seed: int, pool_id: int) -> KVPool:
    kv = KVPool.create(SHAPE, pool_id=pool_id)
    kv.tensor.copy_(torch.randn(SHAPE.dims, generator=torch.Generator().manual_seed(seed)))
    return kv


def info(kv: KVPool, host: str, kind: str = "shm") -> PoolInfo:
    base = kv.info()
    return PoolInfo(base.pool_id, kind, f"seg-{base.pool_id}", "cpu", base.dtype, SHAPE.num_layers,
                    SHAPE.num_blocks, SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim, host)


def wire(message):
    """The message as the other end decodes it (codec frames, as on a socket)."""
    return codec.decode([bytes(memoryview(f)) for f in codec.encode(message)])


def relay_copy(relay: KvRelay, src: KVPool, dst: KVPool, order: CopyBlocks) -> object:
    """Source worker 5 reads, the relay forwards, destination worker 7 writes; its ack."""
    read = wire(relay.start(order, dst_worker=7, src_worker=5))
    writer = BlockWriter(dst, 7)
    ack = None
    for chunk in read_blocks(src, read, 5):
        forwarded = relay.forward(wire(chunk))
        assert forwarded is not None and forwarded[0] == 7
        ack = writer.write(wire(forwarded[1]))
    return ack


def test_blocks_cross_the_relay_byte_exact_in_chunks():
    src, dst = pool(1, 0), pool(2, 1)
    order = CopyBlocks(9, 0, np.array([3, 0, 7, 12, 5], np.int32),
                       np.array([1, 2, 3, 14, 15], np.int32), src=info(src, "10.0.0.1"))
    relay = KvRelay(max_chunk_bytes=2 * BLOCK_BYTES)  # 3 chunks: 2 + 2 + 1 blocks
    ack = relay_copy(relay, src, dst, order)
    assert ack.copy_id == 9 and ack.worker_id == 7 and ack.num_blocks == 5 and ack.error is None
    for s, d in zip(order.src_block_ids, order.dst_block_ids):
        assert torch.equal(dst.tensor[:, :, d], src.tensor[:, :, s])
    untouched = [b for b in range(SHAPE.num_blocks) if b not in order.dst_block_ids]
    assert torch.equal(dst.tensor[:, :, untouched], pool(2, 1).tensor[:, :, untouched])
    assert relay.copies == {} and relay.relayed_bytes == 5 * BLOCK_BYTES


def test_only_other_hosts_pools_need_the_relay():
    src, dst = pool(1, 0), pool(2, 1)
    order = CopyBlocks(1, 0, np.zeros(1, np.int32), np.zeros(1, np.int32), src=info(src, "a"))
    assert needs_relay(order, info(dst, "b"))
    assert not needs_relay(order, info(dst, "a"))  # a segment on its own host: it maps it
    gpu = CopyBlocks(1, 0, np.zeros(1, np.int32), np.zeros(1, np.int32),
                     src=info(src, "a", "cuda_ipc"))
    assert needs_relay(gpu, info(dst, "a", "cuda_ipc"))  # Ray's per-actor GPU numbering
    assert not needs_relay(CopyBlocks(1, 1, np.zeros(1, np.int32), np.zeros(1, np.int32)),
                           info(dst, "b"))


def test_a_source_lost_mid_copy_fails_at_the_destination_after_what_it_was_sent():
    src, dst = pool(1, 0), pool(2, 1)
    order = CopyBlocks(4, 0, np.arange(6, dtype=np.int32), np.arange(6, 12, dtype=np.int32),
                       src=info(src, "a"))
    relay = KvRelay(max_chunk_bytes=2 * BLOCK_BYTES)
    read = relay.start(order, dst_worker=7, src_worker=5)
    writer = BlockWriter(dst, 7)
    first = next(iter(read_blocks(src, read, 5)))
    assert writer.write(relay.forward(first)[1]) is None
    [(worker, failed)] = relay.on_worker_lost(5)
    ack = writer.write(wire(failed))
    assert worker == 7 and ack.copy_id == 4 and "worker 5" in ack.error and ack.num_blocks == 0
    assert relay.copies == {} and relay.on_worker_lost(7) == []


def test_stray_out_of_order_and_bad_chunks_fail_cleanly():
    src, dst = pool(1, 0), pool(2, 1)
    order = CopyBlocks(2, 0, np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32),
                       src=info(src, "a"))
    relay = KvRelay(max_chunk_bytes=BLOCK_BYTES)
    read = relay.start(order, dst_worker=7, src_worker=5)
    chunks = list(read_blocks(src, read, 5))
    assert relay.forward(BlockData(2, 6, 0, 1, "float32", chunks[0].data, False)) is None  # not 5
    assert relay.forward(BlockData(99, 5, 0, 1, "float32", chunks[0].data, False)) is None
    _, failed = relay.forward(chunks[1])  # skipped chunk 0
    assert "out of order" in failed.error and failed.is_last
    bad = list(read_blocks(src, codec_read(2, [0, 99]), 5))
    assert len(bad) == 1 and bad[0].is_last and "out of range" in bad[0].error
    relay.start(order, 7, 5)
    _, failed = relay.forward(bad[0])
    assert "reading the blocks on worker 5 failed" in BlockWriter(dst, 7).write(failed).error


def codec_read(copy_id: int, ids: list[int]):
    from justapi.wire.protocol import ReadBlocks

    return ReadBlocks(copy_id, np.asarray(ids, np.int32))


def test_the_writer_refuses_another_dtype_or_size_and_acks_once():
    src, dst = pool(1, 0), pool(2, 1)
    chunk = next(iter(read_blocks(src, codec_read(3, [1, 2]), 5)))
    from justapi.wire.protocol import WriteBlocks

    writer = BlockWriter(dst, 7)
    assert writer.write(WriteBlocks(3, np.array([0, 1], np.int32), "bfloat16", chunk.data,
                                    False)) is None
    ack = writer.write(WriteBlocks(3, np.array([2, 3], np.int32), "float32", chunk.data, True))
    assert "bfloat16" in ack.error and ack.num_blocks == 0
    ack = writer.write(WriteBlocks(4, np.array([0], np.int32), "float32", chunk.data, True))
    assert "need" in ack.error  # one block's ids, two blocks' bytes
    assert torch.equal(dst.tensor, pool(2, 1).tensor)  # nothing written


# ---------------------------------------------------------------------- the scheduler's links
@pytest.fixture
def links(tmp_path):
    """ClusterLinks as the scheduler opens them from a ray launcher's spec (host "a"), with
    the launcher's control socket listening; workers 0, 1 on host a (pool 0), 2 on b (pool 1)."""
    context = zmq.Context()
    endpoints = dataclasses.replace(Endpoints.in_dir(str(tmp_path)),
                                    workers=f"tcp://127.0.0.1:{free_port()}")
    _, secret = zmq.curve_keypair()
    write_secret_key(str(tmp_path / "server.key"), secret)
    write_authorized_keys(str(tmp_path / "workers.keys"), {})
    spec = ChildSpec("scheduler", 0, ServeConfig(), endpoints, "", extra={
        "host": "a", "worker_curve": {"secret_key_file": str(tmp_path / "server.key"),
                                      "authorized_keys_file": str(tmp_path / "workers.keys")}})
    control = transport.make_socket(context, zmq.PULL, endpoints.control, bind=True)
    readies = {0: remote_ready(0, 10, "a"), 1: remote_ready(1, 11, "a"),
               2: remote_ready(2, 12, "b", pool_id=1)}
    healthy = {0, 1, 2}
    opened = ClusterLinks(context, spec, readies, healthy.__contains__)
    yield opened, healthy, control
    opened.close()
    control.close(0)
    context.term()


def copy_order(copy_id: int, src_pool: int, host: str) -> CopyBlocks:
    ids = np.arange(3, dtype=np.int32)
    return CopyBlocks(copy_id, src_pool, ids, ids + 3,
                      src=remote_ready(9, 0, host, pool_id=src_pool).pool)


def test_a_copy_from_another_host_is_read_by_a_healthy_worker_there(links):
    opened, healthy, _ = links
    plan = object()  # a StepPlan, or anything that is not a copy: as it is
    assert opened.route(0, plan) == [(0, plan)]
    same_host = copy_order(1, 0, "a")
    assert opened.route(1, same_host) == [(1, same_host)]  # it maps host a's segment itself
    healthy.discard(0)
    [(source, read)] = opened.route(2, copy_order(2, 0, "a"))
    assert source == 1 and isinstance(read, ReadBlocks) and read.copy_id == 2
    [(dst, failed)] = opened.on_worker_lost(1)
    assert dst == 2 and isinstance(failed, WriteBlocks) and "worker 1" in failed.error
    healthy.discard(1)
    [(dst, failed)] = opened.route(2, copy_order(3, 0, "a"))
    assert dst == 2 and failed.is_last and "no healthy worker on the host of pool 0" in failed.error


def test_a_worker_on_another_host_is_fenced_by_an_order_to_the_launcher(links):
    opened, _, control = links
    watch = HealthWatch(OpsConfig(), hosts=opened.hosts, gpu_opener=lambda indices: (None, "x"))
    watch.on_ready(remote_ready(2, 12, "b", pool_id=1))
    watch.monitor.mark_unhealthy(2, "no heartbeat for 1.6s")
    assert watch.fence(2)
    assert control.poll(3000)
    [(_, order)] = list(transport.drain(control))
    assert order == FenceWorker(2, 12, "no heartbeat for 1.6s")


# ---------------------------------------------------------------------- health by host
def remote_ready(worker_id: int, pid: int, host: str, pool_id: int = 0) -> Ready:
    return Ready(worker_id, pid, "m", 64, 1024,
                 PoolInfo(pool_id, "shm", "", "cpu", "float32", 2, 64, 4, 1, 8, host))


def test_other_hosts_pids_are_not_looked_up_here_and_fences_go_to_the_launcher():
    fenced: list[tuple[int, int, str]] = []
    watch = HealthWatch(OpsConfig(), hosts=HostHealth("10.0.0.1", lambda *a: fenced.append(a)),
                        gpu_opener=lambda indices: (None, "x"))
    dead_pid = 2**22 + 12345  # no such process here
    watch.on_ready(remote_ready(0, dead_pid, "10.0.0.2"))
    watch.on_ready(remote_ready(1, dead_pid, "10.0.0.1", pool_id=1))
    verdicts = dict(watch.poll())
    assert 0 not in verdicts and verdicts[1] == f"process {dead_pid} exited"
    watch.monitor.mark_unhealthy(0, "no heartbeat for 1.6s")
    assert watch.fence(0) and fenced == [(0, dead_pid, "no heartbeat for 1.6s")]


def test_a_host_whose_workers_are_all_down_is_reported_lost():
    watch = HealthWatch(OpsConfig(), hosts=HostHealth("10.0.0.1", lambda *a: None),
                        gpu_opener=lambda indices: (None, "x"))
    h = Harness(build_scheduler(pool_blocks=64, num_workers=2, shared_pool=False))
    watch.on_ready(remote_ready(0, 11, "10.0.0.2", pool_id=0))
    watch.on_ready(remote_ready(1, 12, "10.0.0.3", pool_id=1))
    watch.monitor.mark_unhealthy(1, "no heartbeat for 1.6s")
    h.kill(1)
    snap = watch.snapshot(h.scheduler)
    assert [row["host"] for row in snap.workers] == ["10.0.0.2", "10.0.0.3"]
    assert "host 10.0.0.3 lost: none of its 1 worker(s) is healthy" in snap.warnings
    assert snap.healthy and snap.problems == []  # degraded: host 10.0.0.2 serves
    assert "pool 1 has no healthy worker" in snap.warnings
    stats = SchedulerStats(time_s=0.0, healthy=snap.healthy, stats={}, workers=snap.workers,
                           problems=snap.problems, warnings=snap.warnings)
    details = _health_details(stats)
    assert details["hosts"] == [
        {"host": "10.0.0.2", "num_workers": 1, "num_workers_healthy": 1},
        {"host": "10.0.0.3", "num_workers": 1, "num_workers_healthy": 0}]


# ---------------------------------------------------------------------- configuration
def test_cluster_keys_need_the_ray_launcher():
    config = build_config({"launcher": "ray", "address": "10.0.0.1:6379", "node-ip": "10.0.0.1",
                           "cpus-per-worker": 2, "cross-host-copy-cost": 0.5}, {"workers": 4})
    assert config.cluster.address == "10.0.0.1:6379" and config.cluster.cpus_per_worker == 2
    with pytest.raises(ConfigError, match="address need launcher = 'ray'"):
        build_config({"address": "10.0.0.1:6379"}, {})
    with pytest.raises(ConfigError, match="address must be HOST:PORT"):
        build_config({"launcher": "ray", "address": "nowhere"}, {})
    with pytest.raises(ConfigError, match="node-ip must be an IP address"):
        build_config({"launcher": "ray", "node-ip": "host.example"}, {})
    with pytest.raises(ConfigError, match="placement must be one of"):
        build_config({"launcher": "ray", "placement": "anywhere"}, {})
    with pytest.raises(ConfigError, match="pd-separate-pools does not apply"):
        build_config({"launcher": "ray", "pd": "1:1", "pd-separate-pools": True}, {})


def test_with_every_host_lost_the_server_is_unhealthy():
    watch = HealthWatch(OpsConfig(), hosts=HostHealth("10.0.0.1", lambda *a: None),
                        gpu_opener=lambda indices: (None, "x"))
    h = Harness(build_scheduler(pool_blocks=64, num_workers=1))
    watch.on_ready(remote_ready(0, 11, "10.0.0.2"))
    watch.monitor.mark_unhealthy(0, "no heartbeat for 1.6s")
    h.kill(0)
    snap = watch.snapshot(h.scheduler)
    assert not snap.healthy and snap.problems == ["pool 0 has no healthy worker"]
    assert "host 10.0.0.2 lost: none of its 1 worker(s) is healthy" in snap.warnings


def test_the_control_plane_imports_neither_torch_nor_ray():
    """Ray is an optional extra (imported when the ray launcher runs), torch the data plane's."""
    code = ("import sys, justapi.launch.serve, justapi.cluster.placement, justapi.cluster.actors, "
            "justapi.cluster.links, justapi.scheduler.process, justapi.scheduler.factory; "
            "found = [m for m in ('torch', 'ray', 'workers') if m in sys.modules]; "
            "assert not found, found")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_hosts_and_imports_are_on_metrics():
    rows = [{"worker_id": 0, "pool_id": 0, "healthy": True, "host": "10.0.0.2"},
            {"worker_id": 1, "pool_id": 1, "healthy": False, "host": "10.0.0.3"}]
    snapshot = SchedulerStats(time_s=0.0, healthy=True, workers=rows,
                              stats={"kv_imports": 3, "kv_import_bytes": 4096, "num_hosts": 2})
    text = FrontendMetrics("m", lambda: snapshot).render().decode()
    found = {(s.name, s.labels.get("host", "")): s.value
             for family in text_string_to_metric_families(text) for s in family.samples}
    assert found[("justapi:kv_imports_total", "")] == 3
    assert found[("justapi:kv_import_bytes_total", "")] == 4096
    assert found[("justapi:num_hosts", "")] == 2
    assert found[("justapi:host_workers_healthy", "10.0.0.2")] == 1
    assert found[("justapi:host_workers_healthy", "10.0.0.3")] == 0
    assert found[("justapi:host_workers", "10.0.0.3")] == 1
