"""`justapi serve` in a mount namespace whose /dev/shm is a 64 MiB tmpfs (Docker's default),
with a model whose KV pool would want twice that: the pool is sized to fit, every page of its
segment can be backed (posix_fallocate over the whole segment succeeds: no SIGBUS can come
later), and it serves; asked for a pool larger than /dev/shm, it refuses to start with one
line naming /dev/shm and --pool-blocks, and leaves nothing running. Skipped only where the
namespace cannot be made (no unshare, no privilege)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tools.harness import ServedPool, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SHM = "64m"
# per block (bf16): 2 layers x K,V x 16 tokens x 4 heads x 16 values x 2 bytes = 8 KiB;
# max-seqs 32 x 512 blocks of context would want 128 MiB
MODEL = "synthetic:layers=2,hidden=64,heads=4,kv_heads=4,ffn=128,context=8192"
MOUNT = f"mount -t tmpfs -o size={SHM},mode=1777 tmpfs /dev/shm"


@pytest.fixture(scope="module")
def in_namespace() -> list[str]:
    """The wrapper that runs a command in a fresh mount namespace with the small /dev/shm."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    for flags in (["-m"], ["-r", "-m"]):  # root; else a user namespace of one's own
        probe = subprocess.run(["unshare", *flags, "sh", "-c", MOUNT], capture_output=True,
                               text=True)
        if probe.returncode == 0:
            return ["unshare", *flags, "sh", "-c", f'{MOUNT} && exec "$@"', "sh"]
    pytest.skip(f"cannot make a mount namespace here: {probe.stderr.strip()}")


def segment_of(pid: int) -> str:
    """The pool's segment as the server's namespace sees it (through /proc/PID/root)."""
    [path] = glob.glob(f"/proc/{pid}/root/dev/shm/justapi-kv-{pid}-*")
    return path


def complete(pool: ServedPool, prompt: str) -> str:
    response = httpx.post(f"{pool.base_url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_the_pool_fits_a_64_mib_dev_shm_and_every_page_can_be_backed(in_namespace) -> None:
    with ServedPool("--model", MODEL, wrap=in_namespace) as pool:
        first = complete(pool, "hello there")
        segment = segment_of(pool.proc.pid)
        size = os.path.getsize(segment)
        assert 32 << 20 < size <= 64 << 20  # sized down from 128 MiB, to the tmpfs
        fd = os.open(segment, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)  # every page backed now: ENOSPC would raise
        finally:
            os.close(fd)
        assert complete(pool, "hello there") == first
        assert httpx.get(f"{pool.base_url}/health", timeout=10).status_code == 200
        assert all(pid_alive(pid) for pid in pool.children)
        assert pool.stop() == 0, pool.log()


def test_a_pool_larger_than_dev_shm_is_refused_at_start(in_namespace) -> None:
    result = subprocess.run([*in_namespace, sys.executable, "-m", "justapi.cli", "serve",
                             "--model", MODEL, "--pool-blocks", "10000", "--port", "0"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("justapi: error: the KV pool of 10000 blocks needs 78 MiB of "
                               "/dev/shm, which has 64 MiB free: lower --pool-blocks (at most ")
    assert "--shm-size" in lines[0]
