"""The scheduler's health watch over a real scheduler core, with an injected GPU reader and
clock: GPU faults retire workers, CPU figures without NVML, fencing, process exits, restarts,
and the problems / warnings that /health shows."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from justapi.config.ops import OpsConfig
from justapi.health.nvml import NvmlReader
from justapi.health.watch import HealthWatch, cuda_index_of, process_state
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire.protocol import Heartbeat, PoolInfo, Ready
from tests.support.fake_nvml import FakeDevice, FakeNvml


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ready(worker_id: int, pid: int = 0, device: str = "cpu", kind: str = "shm",
          pool_id: int = 0, num_blocks: int = 64) -> Ready:
    info = PoolInfo(pool_id, kind, "", device, "float32", 2, num_blocks, 4, 1, 8)
    return Ready(worker_id, pid, "m", 64, 1024, info)


def gpu_setup(config: OpsConfig | None = None) -> tuple[HealthWatch, FakeNvml, Harness, Clock]:
    """Two GPU workers, a pool each, watched through a fake NVML."""
    nvml = FakeNvml([FakeDevice("GPU-0"), FakeDevice("GPU-1")])
    clock = Clock()
    watch = HealthWatch(config or OpsConfig(), launcher_pid=os.getpid(), clock=clock,
                        gpu_opener=lambda indices: (NvmlReader(nvml), "ok"))
    harness = Harness(build_scheduler(pool_blocks=64, num_workers=2, shared_pool=False))
    for worker_id in (0, 1):
        watch.on_ready(ready(worker_id, device=f"cuda:{worker_id}", kind="cuda_ipc",
                             pool_id=worker_id))
    return watch, nvml, harness, clock


def beat(watch: HealthWatch, clock: Clock, *worker_ids: int) -> None:
    for worker_id in worker_ids:
        watch.on_heartbeat(Heartbeat(worker_id=worker_id, time_s=clock.now, rss_bytes=1 << 20))


def test_gpu_figures_reach_the_table_and_the_snapshot():
    watch, nvml, h, clock = gpu_setup()
    assert watch.poll() == []
    snap = watch.snapshot(h.scheduler)
    assert snap.healthy and snap.nvml == "ok" and len(snap.gpus) == 2
    row = snap.workers[1]
    assert row["gpu_uuid"] == "GPU-1" and row["gpu_temperature_c"] == 45.0
    assert row["gpu_memory_total_bytes"] == 80 << 30 and row["draining"] is False


def test_a_double_bit_ecc_error_retires_the_workers_of_that_gpu():
    watch, nvml, h, clock = gpu_setup()
    h.submit("a", [3, 4, 5, 6, 7, 8], max_tokens=6, ignore_eos=True)
    h.submit("b", [9, 4, 5, 6, 7, 8], max_tokens=6, ignore_eos=True)
    watch.poll()  # baseline readings
    h.step()
    nvml.devices[0].ecc[1] = 1
    clock.now += 1.0
    beat(watch, clock, 0, 1)
    assert watch.poll() == [(0, "GPU cuda:0: 1 new uncorrected (double-bit) ECC error(s)")]
    deltas = watch.retire(h.scheduler, 0)
    assert deltas.request_ids == []  # re-queued on pool 1, not failed
    h.scheduler.check_invariants()
    stats = h.scheduler.stats()
    assert stats["worker_0_is_healthy"] == 0.0 and stats["pool_0_prefix_cache_blocks"] == 0
    h.run()
    assert set(h.finish_reasons.values()) == {"length"}
    snap = watch.snapshot(h.scheduler)
    assert snap.problems == ["pool 0 has no healthy worker"]
    assert snap.warnings == ["worker 0 unhealthy: GPU cuda:0: 1 new uncorrected (double-bit) "
                             "ECC error(s)"]


def test_a_thermal_limit_held_too_long_is_fatal():
    watch, nvml, h, clock = gpu_setup(OpsConfig(thermal_hold_s=5.0, gpu_poll_interval_s=1.0))
    nvml.devices[1].temperature_c = 95
    for _ in range(5):
        assert watch.poll() == []
        clock.now += 1.0
        beat(watch, clock, 0, 1)
    found = watch.poll()
    assert found == [(1, "GPU cuda:1 held its thermal limit for 5s (95 C, slowdown at 90 C)")]


def test_without_nvml_the_table_keeps_cpu_figures():
    clock = Clock()
    watch = HealthWatch(OpsConfig(), launcher_pid=os.getpid(), clock=clock,
                        gpu_opener=lambda indices: (None, "unavailable: no driver"))
    h = Harness(build_scheduler(pool_blocks=64, num_workers=1))
    watch.on_ready(ready(0, device="cuda:0", kind="cuda_ipc"))
    beat(watch, clock, 0)
    assert watch.poll() == []
    snap = watch.snapshot(h.scheduler)
    assert snap.healthy and snap.nvml == "unavailable: no driver" and snap.gpus == []
    assert snap.workers[0]["rss_bytes"] == 1 << 20 and "gpu_temperature_c" not in snap.workers[0]


def test_missed_heartbeats_and_a_hung_step():
    clock = Clock()
    watch = HealthWatch(OpsConfig(step_timeout_s=30.0), launcher_pid=os.getpid(), clock=clock,
                        gpu_opener=lambda indices: (None, "x"))
    watch.on_ready(ready(0))
    watch.on_ready(ready(1))
    watch.on_step_sent(1, 5)
    clock.now += 1.6
    beat(watch, clock, 1)
    assert watch.poll() == [(0, "no heartbeat for 1.6s")]
    for _ in range(30):
        clock.now += 1.0
        beat(watch, clock, 1)
    (worker_id, reason), = watch.poll()
    assert worker_id == 1 and reason.startswith("step 5 in flight for 32s (hung")


def test_not_progressing_and_all_draining_are_problems():
    clock = Clock()
    watch = HealthWatch(OpsConfig(step_timeout_s=10.0), launcher_pid=os.getpid(), clock=clock,
                        gpu_opener=lambda indices: (None, "x"))
    h = Harness(build_scheduler(pool_blocks=64, num_workers=1))
    watch.on_ready(ready(0))
    h.scheduler.set_draining(0)
    h.submit("r", [3, 4, 5], max_tokens=2)
    assert watch.snapshot(h.scheduler).problems == [
        "pool 0: every healthy worker is draining (new requests wait for an undrain)"]
    clock.now += 11.0
    beat(watch, clock, 0)
    snap = watch.snapshot(h.scheduler)
    assert snap.problems[-1] == ("not progressing: no step finished for 11s with 1 unfinished "
                                 "request(s)")
    assert snap.warnings == ["worker 0 is draining"] and not snap.healthy
    h.scheduler.set_draining(0, False)
    h.run()
    assert watch.snapshot(h.scheduler).healthy


def test_fence_kills_only_a_sibling_process_and_exits_are_seen():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = HealthWatch(OpsConfig(), launcher_pid=os.getpid(),
                            gpu_opener=lambda indices: (None, "x"))
        watch.on_ready(ready(0, pid=child.pid))
        watch.on_ready(ready(1, pid=os.getpid()))  # not a child of the "launcher": never killed
        assert process_state(child.pid) in ("R", "S", "D")  # alive (D: still loading, under load)
        assert watch.poll() == []
        assert not watch.fence(1)
        assert watch.fence(0)
        deadline = time.monotonic() + 5
        while process_state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.15)  # past the liveness check interval
        assert watch.poll() == [(0, f"process {child.pid} exited")]
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL


def test_a_replacement_worker_rejoins_and_its_dead_pool_is_forgotten():
    watch, nvml, h, clock = gpu_setup()
    h.submit("a", [3, 4, 5, 6, 7, 8, 9, 10, 11], max_tokens=2, ignore_eos=True)
    h.run()
    assert h.scheduler.stats()["pool_0_prefix_cache_blocks"] > 0
    # The new process (this test's pid: alive, and never fenced as it is not the launcher's).
    new_pid = os.getpid()
    deltas = watch.rejoin(h.scheduler, ready(0, pid=new_pid, device="cuda:0", kind="cuda_ipc"))
    assert deltas is not None and deltas.request_ids == []
    stats = h.scheduler.stats()
    assert stats["worker_0_is_healthy"] == 1.0
    assert stats["pool_0_prefix_cache_blocks"] == 0  # its KV memory died with the old process
    row = watch.monitor.table()[0]
    assert row["pid"] == new_pid and row["num_restarts"] == 1 and row["healthy"]
    bad = watch.rejoin(h.scheduler, ready(1, pid=os.getppid(), device="cuda:1", kind="cuda_ipc",
                                          pool_id=1, num_blocks=8))
    assert bad is not None  # the old worker 1 was retired first
    assert watch.poll()[0][1].startswith("cannot rejoin: worker 1 reports 8 blocks")


def test_unreachable_worker_is_retired():
    watch, nvml, h, clock = gpu_setup()
    watch.on_unreachable(1, "Host unreachable")
    assert watch.poll() == [(1, "unreachable (Host unreachable)")]


@pytest.mark.parametrize("device,index", [("cpu", None), ("cuda", 0), ("cuda:3", 3)])
def test_cuda_index_of(device: str, index: int | None):
    assert cuda_index_of(device) == index
