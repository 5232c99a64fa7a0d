"""The CPU KV pool sized to what the host gives (justapi/launch/memory_limits.py, shm_pool.py):
cgroup v1 and v2 files read as the kernel writes them (in a directory laid out like /), and
a pool that would not fit /dev/shm, the cgroup's limit beside the server's processes, or free
RAM refused at start with one line naming the limit and the flag - never sized past them."""
from __future__ import annotations

from pathlib import Path

import pytest

from justapi.config.fields import ConfigError
from justapi.config.serve import build_config
from justapi.launch.memory_limits import MIB, CgroupMemory, MemoryLimits, read_cgroup
from justapi.launch.shm_pool import SHM_SHARE, plan_cpu_pool, process_needs_bytes
from justapi.model.info import ModelInfo

GIB = 1 << 30
MODEL = ModelInfo(path="/nonexistent.gguf", name="m", architecture="llama", num_layers=30,
                  hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, context_length=8192,
                  vocab_size=49152)
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2  # bf16: 360 KiB


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root = write(tmp_path, {
        "proc/self/cgroup": "0::/kube/pod1/app\n",
        "sys/fs/cgroup/kube/memory.max": "max\n", "sys/fs/cgroup/kube/memory.current": "9\n",
        "sys/fs/cgroup/kube/pod1/memory.max": f"{2 * GIB}\n",
        "sys/fs/cgroup/kube/pod1/memory.current": f"{GIB}\n",
        "sys/fs/cgroup/kube/pod1/memory.stat": f"anon 5\ninactive_file {256 * MIB}\n",
        "sys/fs/cgroup/kube/pod1/app/memory.max": f"{4 * GIB}\n",
        "sys/fs/cgroup/kube/pod1/app/memory.current": f"{GIB}\n"})
    cgroup = read_cgroup(str(root))
    assert cgroup == CgroupMemory(2 * GIB, GIB, 256 * MIB,
                                  str(root / "sys/fs/cgroup/kube/pod1/memory.max"))
    assert cgroup.free == GIB + 256 * MIB


def test_cgroup_v1_inside_a_container_and_unlimited(tmp_path: Path) -> None:
    """A container's mount shows its own cgroup at the top: /proc's path is not there."""
    files = {"proc/self/cgroup": "5:cpu:/x\n4:memory:/docker/abc\n0::/\n",
             "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GIB}\n",
             "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{300 * MIB}\n",
             "sys/fs/cgroup/memory/memory.stat": f"cache 1\ntotal_inactive_file {100 * MIB}\n"}
    cgroup = read_cgroup(str(write(tmp_path, files)))
    assert cgroup is not None and (cgroup.limit, cgroup.free) == (GIB, 824 * MIB)
    write(tmp_path, {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert read_cgroup(str(tmp_path)) is None
    assert read_cgroup(str(tmp_path / "nowhere")) is None


def test_this_hosts_readings() -> None:
    limits = MemoryLimits.read()
    assert limits.available > 0 and limits.shm_free is not None and limits.shm_size is not None
    assert 0 <= limits.shm_free <= limits.shm_size


def plan(limits: MemoryLimits, **flags: object):
    config = build_config({}, {k.replace("_", "-"): v for k, v in flags.items()})
    return plan_cpu_pool(MODEL, config.cache, config.scheduler, limits=limits)


def test_an_automatic_pool_fits_a_small_dev_shm() -> None:
    """The Docker default of 64 MiB: the pool takes SHM_SHARE of it, not a fraction of RAM."""
    limits = MemoryLimits(available=16 * GIB, shm_free=64 * MIB, shm_size=64 * MIB)
    sized = plan(limits)
    assert sized.num_blocks == int(64 * MIB * SHM_SHARE) // BLOCK_BYTES == 163
    assert sized.num_bytes <= 64 * MIB
    roomy = plan(MemoryLimits(available=16 * GIB, shm_free=64 * GIB, shm_size=64 * GIB))
    assert roomy.num_blocks == 4 * GIB // BLOCK_BYTES  # kv-memory-fraction 0.25 of RAM


def test_an_automatic_pool_leaves_the_cgroup_room_for_the_processes() -> None:
    reserve = process_needs_bytes(MODEL.path, 1)
    cgroup = CgroupMemory(limit=GIB, usage=100 * MIB, reclaimable=0, path="/sys/fs/cgroup/memory.max")
    sized = plan(MemoryLimits(available=16 * GIB, cgroup=cgroup, shm_free=8 * GIB))
    assert sized.num_blocks == min(int(cgroup.free * 0.25), cgroup.free - reserve) // BLOCK_BYTES
    assert sized.num_bytes + reserve <= cgroup.free


@pytest.mark.parametrize("limits,flags,needles", [
    (MemoryLimits(16 * GIB, shm_free=64 * MIB, shm_size=64 * MIB), {"pool_blocks": 1000},
     ["of /dev/shm, which has 64 MiB free", "--pool-blocks (at most 182)", "--shm-size"]),
    (MemoryLimits(16 * GIB, CgroupMemory(GIB, 600 * MIB, 0, "/cg/memory.max"), 8 * GIB),
     {"pool_blocks": 1000}, ["cgroup memory limit (/cg/memory.max: 1024 MiB, 600 MiB in use)",
                             "lower --pool-blocks", "docker run --memory"]),
    (MemoryLimits(GIB // 2, shm_free=8 * GIB), {"pool_blocks": 2000},
     ["more than the 512 MiB of free memory", "--pool-blocks (at most 1456)"]),
    (MemoryLimits(16 * GIB, shm_free=MIB, shm_size=64 * MIB), {},
     ["/dev/shm has 1 MiB free, room for 2 KV blocks", "--shm-size"]),
    (MemoryLimits(16 * GIB, CgroupMemory(GIB, 900 * MIB, 0, "/cg/memory.max"), 8 * GIB), {},
     ["leaves no room for a KV pool", "docker run --memory"]),
])
def test_a_pool_that_cannot_fit_is_refused_with_one_line(limits, flags, needles) -> None:
    with pytest.raises(ConfigError) as info:
        plan(limits, **flags)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_separate_pd_pools_share_dev_shm() -> None:
    """Two segments (--pd-separate-pools) must both fit /dev/shm."""
    limits = MemoryLimits(16 * GIB, shm_free=64 * MIB, shm_size=64 * MIB)
    config = build_config({}, {})
    one = plan_cpu_pool(MODEL, config.cache, config.scheduler, limits=limits)
    two = plan_cpu_pool(MODEL, config.cache, config.scheduler, limits=limits, num_pools=2)
    assert two.num_blocks == int(64 * MIB * SHM_SHARE) // (2 * BLOCK_BYTES) < one.num_blocks
