"""Security of a live pool: HTTP on 127.0.0.1 unless told otherwise, the API key on every route
but /health (and never in a log, a command line or another process's environment), the
private runtime dir (0700) and shared-memory pool (0600), prompts out of the logs unless
--log-requests, and a ZMQ tcp endpoint beyond loopback only with CURVE keys."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import zmq

from justapi.client import Client
from justapi.wire.codec import encode
from justapi.wire.auth import write_key_pair
from justapi.wire.protocol import QueryStats
from tools.harness import TINY_MODEL, ServedPool, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-e2e-5c0ffee9a1b2c3d4e5f6"
MARKER = "unique-prompt-text-4e1d7a"


@pytest.fixture(scope="module")
def keyed_pool():
    os.environ["JUSTAPI_API_KEY"] = API_KEY
    try:
        served = ServedPool("--model", TINY_MODEL, "--pool-blocks", "64", "--log-level", "debug")
    finally:
        del os.environ["JUSTAPI_API_KEY"]
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []


def listening_addresses(port: int) -> list[str]:
    """Local addresses with a listening TCP socket on `port` (from /proc/net/tcp{,6})."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in list(handle)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_http_binds_loopback_only_by_default(keyed_pool):
    assert listening_addresses(keyed_pool.port) == ["0100007F"]  # 127.0.0.1, nothing else
    assert f"HTTP  http://127.0.0.1:{keyed_pool.port}/v1" in keyed_pool.log()


def test_runtime_dir_is_private_and_the_kv_segment_is_0600(keyed_pool):
    runtime_dir = keyed_pool.runtime_dir
    assert runtime_dir and stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
    for name in os.listdir(runtime_dir):
        assert os.stat(os.path.join(runtime_dir, name)).st_uid == os.getuid()
    segments = [n for n in os.listdir("/dev/shm")
                if n.startswith(f"justapi-kv-{keyed_pool.proc.pid}-")]
    assert segments
    for name in segments:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600


def test_api_key_everywhere_but_health_and_never_leaked(keyed_pool):
    url = keyed_pool.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers={"authorization": "Bearer nope"}).status_code == 401
    body = {"prompt": MARKER, "max_tokens": 4, "ignore_eos": True}
    refused = httpx.post(f"{url}/v1/completions", json=body)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.post(f"{url}/v1/completions", json=body,
                    headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    log = keyed_pool.log()
    assert API_KEY not in log
    assert MARKER not in log  # debug logging, and still no prompt text without --log-requests
    for pid in keyed_pool.children:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            assert API_KEY.encode() not in handle.read()
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read()
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            is_frontend = b"justapi.frontend.process" in handle.read()
        assert (API_KEY.encode() in environ) == is_frontend  # only the frontend holds it


def test_non_loopback_zmq_needs_curve_keys(tmp_path):
    port = free_port()
    result = subprocess.run([sys.executable, "-m", "justapi.cli", "serve", "--model", TINY_MODEL,
                             "--zmq", f"tcp://0.0.0.0:{port}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("justapi: error: zmq tcp://0.0.0.0"), lines
    assert "--zmq-curve-secret-key" in lines[0]
    secret, public = write_key_pair(str(tmp_path / "server.key"))
    os.chmod(secret, 0o644)
    result = subprocess.run([sys.executable, "-m", "justapi.cli", "serve", "--model", TINY_MODEL,
                             "--zmq", f"tcp://0.0.0.0:{port}", "--zmq-curve-secret-key", secret],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "chmod 600" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_curve_endpoint_and_log_requests(tmp_path):
    secret, public = write_key_pair(str(tmp_path / "server.key"))
    server_key = Path(public).read_bytes().strip()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with ServedPool("--model", TINY_MODEL, "--pool-blocks", "64", "--log-requests",
                    "--zmq", endpoint.replace("127.0.0.1", "0.0.0.0"),
                    "--zmq-curve-secret-key", secret) as pool:
        assert f"server public key {server_key.decode()}" in pool.log()
        with Client(endpoint, timeout_s=60, server_public_key=server_key) as client:
            done = client.complete(MARKER, max_tokens=3, ignore_eos=True)
            assert len(done.token_ids) == 3
        assert no_answer_without_the_key(endpoint)
        response = httpx.post(f"{pool.base_url}/v1/completions", timeout=60,
                              json={"prompt": MARKER + " http", "max_tokens": 2})
        assert response.status_code == 200
        assert MARKER in pool.log() and MARKER + " http" in pool.log()
        assert pool.stop(signal.SIGTERM) == 0
        assert pool.leftovers() == []


def no_answer_without_the_key(endpoint: str) -> bool:
    """A plain (non-CURVE) peer never completes the handshake: its send or its receive times
    out, no stats come back."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode(QueryStats("q")))
        sock.recv_multipart()
        return False
    except zmq.Again:
        return True
    finally:
        sock.close()
        context.term()
