"""State files of running servers: written privately, newest live one first, stale ones
(a launcher that died without cleaning up) skipped and removed; clear errors otherwise."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from justapi.launch import discovery
from justapi.ops.admin_client import AdminClient, AdminError


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "state")
    monkeypatch.setenv(discovery.STATE_DIR_ENV, path)
    return path


def record(pid: int, runtime_dir: str, started_at: float, name: str = "m") -> discovery.ServerRecord:
    return discovery.ServerRecord(pid=pid, admin=f"ipc://{runtime_dir}/admin.sock",
                                  client="", http_url="http://127.0.0.1:1", model=name,
                                  runtime_dir=runtime_dir, started_at=started_at)


def test_newest_live_server_wins_and_stale_files_go(state_dir, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live_dir = tmp_path / "rt"
    live_dir.mkdir()
    try:
        old = discovery.publish(record(sleeper.pid, str(live_dir), 1.0, "old"))
        new = discovery.publish(record(os.getpid(), str(live_dir / "new"), 2.0, "new"))
        (live_dir / "new").mkdir()
        stale = discovery.publish(record(dead.pid, str(live_dir), 3.0, "stale"))
        no_dir = discovery.publish(record(os.getppid(), str(tmp_path / "gone"), 4.0, "no dir"))
        servers = discovery.running_servers()
        assert [s.model for s in servers] == ["new", "old"]
        assert not os.path.exists(stale) and not os.path.exists(no_dir)  # stale: removed
        assert os.path.exists(old) and os.path.exists(new)
        assert discovery.default_admin_endpoint() == f"ipc://{live_dir}/new/admin.sock"
        assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(old).st_mode) == 0o600
    finally:
        sleeper.kill()
        sleeper.wait()


def test_nothing_running_says_what_to_do(state_dir):
    with pytest.raises(discovery.DiscoveryError, match="no running justapi server found"):
        discovery.default_admin_endpoint()
    with pytest.raises(AdminError, match="pass --admin ENDPOINT"):
        AdminClient()


def test_a_missing_ipc_socket_fails_at_once(tmp_path):
    with pytest.raises(AdminError, match="no admin socket at ipc://.*nothing.sock"):
        AdminClient(f"ipc://{tmp_path}/nothing.sock")


def test_a_silent_endpoint_times_out_with_a_clear_error(tmp_path):
    silent = tmp_path / "silent.sock"
    silent.touch()  # exists, but nobody listens
    with AdminClient(f"ipc://{silent}", timeout_s=0.2) as client:
        with pytest.raises(AdminError, match=r"no answer from the admin socket .* in 0.2s"):
            client.status()


def test_garbage_files_are_ignored(state_dir):
    os.makedirs(state_dir, mode=0o700)
    with open(os.path.join(state_dir, "123.json"), "w") as handle:
        handle.write("{not json")
    assert discovery.running_servers() == []
