"""A launcher killed outright (SIGKILL, the OOM killer) cannot unlink its KV segment; the next
start removes the segments no live launcher locks (shm_pool.sweep_stale_segments), and never
one a live launcher holds, one too young to be locked yet, or a file that is not a segment."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from justapi.launch.shm_pool import STALE_AGE_S, PoolPlan, SharedPoolSegment, sweep_stale_segments
from justapi.wire.protocol import SHM_PREFIX

OLD = time.time() - 2 * STALE_AGE_S


def _file(directory: Path, name: str, mtime: float = OLD) -> Path:
    path = directory / name
    path.write_bytes(b"\0" * 4096)
    os.utime(path, (mtime, mtime))
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_old_unlocked_segments_of_dead_creators_are_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    stale = _file(tmp_path, f"{SHM_PREFIX}{dead}-aaaa")
    held = _file(tmp_path, f"{SHM_PREFIX}{dead}-bbbb")
    young = _file(tmp_path, f"{SHM_PREFIX}{dead}-cccc", mtime=time.time())
    older_version = _file(tmp_path, f"{SHM_PREFIX}{os.getpid()}-dddd")  # unlocked, its creator lives
    other = _file(tmp_path, "not-a-segment")
    fd = os.open(held, os.O_RDONLY)  # another open file's shared lock: a live launcher's
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        assert sweep_stale_segments(str(tmp_path)) == [stale.name]
        assert not stale.exists() and all(p.exists() for p in (held, young, older_version, other))
    finally:
        os.close(fd)
    assert sweep_stale_segments(str(tmp_path)) == [held.name]  # its holder gone
    assert sweep_stale_segments(str(tmp_path / "missing")) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_killed_launchers_segment_is_swept_and_a_live_one_is_kept() -> None:
    plan = PoolPlan(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=1, head_dim=8)
    code = ("import sys, time; from justapi.launch.shm_pool import PoolPlan, SharedPoolSegment;"
            f"s = SharedPoolSegment.create(PoolPlan(**{plan.__dict__!r}));"
            "print(s.shm.name, flush=True); time.sleep(60)")
    # its own process group: the kill takes Python's resource tracker with it (alone, the tracker
    # would unlink the segment itself), as a group or container kill or the OOM killer does
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    live = SharedPoolSegment.create(plan)
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        assert name.startswith(SHM_PREFIX) and os.path.exists(f"/dev/shm/{name}")
        for segment in (name, live.shm.name):  # old enough: only the locks keep them
            os.utime(f"/dev/shm/{segment}", (OLD, OLD))
        assert name not in sweep_stale_segments()  # its launcher lives
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        time.sleep(0.5)  # (had a tracker outlived the kill, it would unlink the segment by now)
        assert os.path.exists(f"/dev/shm/{name}")  # nothing unlinked it
        removed = sweep_stale_segments()
        assert name in removed and live.shm.name not in removed
        assert not os.path.exists(f"/dev/shm/{name}") and os.path.exists(f"/dev/shm/{live.shm.name}")
    finally:
        live.unlink()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert live.lock_fd is None and not os.path.exists(f"/dev/shm/{live.shm.name}")
