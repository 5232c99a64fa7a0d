"""End-to-end failure handling and operations on the real process pool (tiny synthetic model):
SIGKILL a worker mid-load (every request completes, /health reports it, no block leaks, the
replacement serves again), SIGSTOP a worker (caught by missed heartbeats), drain/undrain, each
ops command (`justapi status`, `health`, `flush-cache`, `drain`) against the live server (found
through its state file), `justapi bench serve` against it, and a pool left with no worker
failing requests with a clear error instead of hanging."""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from justapi.ops.admin_client import AdminClient
from tools.harness import TINY_MODEL, ServedPool, child_pids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "the health of a worker pool is watched by its scheduler " * 3
WAIT_S = 60.0  # generous upper bounds for slow, shared machines: waits, not timing checks


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    """Servers of this module publish their state files here, not in the user's dir."""
    path = str(tmp_path_factory.mktemp("state"))
    old = os.environ.get("JUSTAPI_STATE_DIR")
    os.environ["JUSTAPI_STATE_DIR"] = path
    yield path
    if old is None:
        del os.environ["JUSTAPI_STATE_DIR"]
    else:
        os.environ["JUSTAPI_STATE_DIR"] = old


@pytest.fixture(scope="module")
def pool(state_dir):
    served = ServedPool("--config", str(ROOT / "configs" / "cpu-workers.toml"), "--model",
                        TINY_MODEL, "--pool-blocks", "512", "--max-seqs", "16")
    yield served
    served.children = child_pids(served.proc.pid)  # replacements included
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []
    assert os.listdir(state_dir) == []  # the state file went with the server


def admin() -> AdminClient:
    return AdminClient(timeout_s=10)  # the newest live server, through its state file


def status():
    with admin() as client:
        return client.status()


def wait_for(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def worker(reply, worker_id: int) -> dict:
    return next(w for w in reply.workers if w["worker_id"] == worker_id)


def complete(pool: ServedPool, max_tokens: int, prompt: str = PROMPT) -> dict:
    response = httpx.post(f"{pool.base_url}/v1/completions", timeout=WAIT_S * 2, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def run_load(pool: ServedPool, num_requests: int, max_tokens: int):
    executor = concurrent.futures.ThreadPoolExecutor(num_requests)
    futures = [executor.submit(complete, pool, max_tokens, f"{i} {PROMPT}")
               for i in range(num_requests)]
    executor.shutdown(wait=False)
    return futures


def assert_all_complete(futures, max_tokens: int) -> None:
    for future in futures:
        body = future.result(timeout=WAIT_S * 2)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == max_tokens


def assert_no_leaked_block() -> None:
    with admin() as client:
        wait_for(lambda: client.status().stats["num_requests_running"] == 0, "requests to finish")
        stats = client.status().stats
        assert stats["kv_blocks_in_use"] == 0
        assert stats["kv_blocks_free"] + stats["prefix_cache_blocks"] == stats["kv_blocks_total"]
        check = client.check_invariants()
        assert check.ok, check.message


def justapi(command: str, *args: str) -> subprocess.CompletedProcess:
    """`justapi COMMAND ARGS` in a process of its own, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "justapi.cli", command, *args],
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------ commands
def test_each_command_against_the_live_server(pool):
    result = justapi("status", "--json")
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)["status"]
    assert reply["healthy"] and [w["worker_id"] for w in reply["workers"]] == [0, 1]
    assert reply["stats"]["kv_blocks_total"] == 512
    text = justapi("status", "--check-invariants").stdout
    assert "workers" in text and "queues" in text and "prefix cache" in text
    assert "invariants: invariants hold (512 blocks" in text
    result = justapi("health", "--json")
    health = json.loads(result.stdout)
    assert result.returncode == 0 and health["healthy"] and health["nvml"] == "not needed (CPU workers)"
    assert all(w["rss_bytes"] > 0 and w["pool"]["kind"] == "shm" and w["pool"]["is_linked"]
               for w in health["workers"])
    assert "healthy; NVML: not needed (CPU workers)" in justapi("health").stdout
    complete(pool, 4)
    cached = status().stats["prefix_cache_blocks"]
    assert cached > 0
    result = justapi("flush-cache")
    assert result.returncode == 0
    assert result.stdout.startswith(f"flushed {int(cached)} unreferenced prefix-cache block(s)")
    assert status().stats["prefix_cache_blocks"] == 0
    refused = justapi("drain", "7")
    assert refused.returncode == 1 and refused.stdout.startswith("unknown worker 7")
    assert json.loads(justapi("drain", "1", "--json").stdout)["ok"]
    assert worker(status(), 1)["draining"]
    assert justapi("drain", "1", "--undrain").stdout.startswith("worker 1: accepting new requests")


def test_bench_serve_against_the_live_server(pool, tmp_path):
    """The load generator on a real pool: every request completes with exactly its tokens, and
    the figures it prints and writes agree with each other and with the server's counters."""
    before = status().stats["num_generated_tokens"]
    out_json, plot = tmp_path / "bench.json", tmp_path / "cdf.png"
    args = ["--base-url", pool.base_url, "--workload", "batch", "--num-requests", "6",
            "--concurrency", "3", "--max-tokens", "8", "--prompt-tokens", "16", "--ignore-eos",
            "--json", str(out_json)]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    result = justapi("bench", "serve", *args, *(["--plot", str(plot)] if has_matplotlib else []))
    assert result.returncode == 0, result.stderr
    assert "100%" in result.stderr and "6/6" in result.stderr  # the progress bar, on stderr
    report = json.loads(out_json.read_text())
    summary = report["summary"]
    assert summary["num_ok"] == 6 and summary["num_failed"] == 0
    assert summary["total_output_tokens"] == 6 * 8  # usage.completion_tokens, --ignore-eos
    assert report["config"]["model"] == "synthetic-llama-2x64-f32"
    records = report["requests"]
    assert all(r["ok"] and r["output_tokens_source"] == "usage" for r in records)
    assert all(r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] > 0 for r in records)
    lines = result.stdout.splitlines()
    assert lines[0].strip("= ") == "batch / completions"
    assert "Requests ok / failed:" in lines[1] and lines[1].split()[-3:] == ["6", "/", "0"]
    assert lines[6].split()[-3:] == [str(6 * 8), "/", str(summary["total_prompt_tokens"])]
    ttft_p50 = next(line for line in lines if line.startswith("TTFT")).split()[1]
    assert ttft_p50 == f"{summary['ttft_ms']['p50']:.2f}"
    wait_for(lambda: status().stats["num_generated_tokens"] >= before + 6 * 8,
             "the server to count the generated tokens")
    stats = status().stats  # the workers report their step times; the scheduler fits them
    assert any(stats.get(f"worker_{w}_step_fixed_s", 0) + 16 * stats.get(
        f"worker_{w}_step_prefill_token_s", 0) > 0 for w in (0, 1))
    if has_matplotlib:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------ drain
def test_drain_keeps_new_requests_off_a_worker_until_undrain(pool):
    with admin() as client:
        reply = client.drain(1)
        assert reply.ok
        wait_for(lambda: httpx.get(f"{pool.base_url}/health").json()["status"] == "degraded",
                 "/health to show the drain")
        health = httpx.get(f"{pool.base_url}/health").json()
        assert "worker 1 is draining" in health["warnings"]
        steps_1 = client.status().stats["worker_1_num_steps"]
        assert_all_complete(run_load(pool, 6, 24), 24)
        assert client.status().stats["worker_1_num_steps"] == steps_1  # nothing ran there
        assert client.drain(1, is_draining=False).ok
        assert_all_complete(run_load(pool, 6, 24), 24)
        assert client.status().stats["worker_1_num_steps"] > steps_1
        assert not worker(client.status(), 1)["draining"]


# ------------------------------------------------------------------------------ failures
def test_sigkill_a_worker_mid_load(pool):
    before = status()
    victim = worker(before, 0)["pid"]
    futures = run_load(pool, 12, 300)
    wait_for(lambda: all(w["num_requests_running"] for w in status().workers),
             "both workers to run requests")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    down = wait_for(lambda: (r := status()) and not worker(r, 0)["healthy"] and r, "the verdict")
    print(f"SIGKILL detected after {time.monotonic() - killed_at:.2f}s")
    assert worker(down, 0)["reason"] == f"process {victim} exited"
    assert down.stats["num_preemptions"] > before.stats["num_preemptions"]  # re-queued mid-load
    health = httpx.get(f"{pool.base_url}/health")
    assert health.status_code == 200  # worker 1 still serves the pool
    body = health.json()
    if body["status"] == "degraded":  # unless the replacement already rejoined
        assert any(w["worker_id"] == 0 and not w["healthy"] for w in body["workers"])
    assert_all_complete(futures, 300)
    back = wait_for(lambda: (r := status()) and worker(r, 0)["healthy"] and r, "a replacement")
    assert worker(back, 0)["pid"] != victim and worker(back, 0)["num_restarts"] == 1
    assert_no_leaked_block()
    with admin() as client:  # the replacement serves: with worker 1 drained, only it can
        client.drain(1)
        steps_0 = client.status().stats["worker_0_num_steps"]
        assert_all_complete(run_load(pool, 3, 16), 16)
        assert client.status().stats["worker_0_num_steps"] > steps_0
        client.drain(1, is_draining=False)
    wait_for(lambda: httpx.get(f"{pool.base_url}/health").json()["status"] == "ok",
             "/health to be ok again")


def test_sigstop_a_worker_is_caught_by_missed_heartbeats(pool):
    victim = worker(status(), 1)["pid"]
    futures = run_load(pool, 8, 200)
    wait_for(lambda: worker(status(), 1)["num_requests_running"], "worker 1 to run requests")
    os.kill(victim, signal.SIGSTOP)
    try:
        down = wait_for(lambda: (r := status()) and not worker(r, 1)["healthy"] and r,
                        "the verdict")
        assert worker(down, 1)["reason"].startswith("no heartbeat for ")
        assert_all_complete(futures, 200)
    finally:
        try:
            os.kill(victim, signal.SIGCONT)  # only if the test failed before the fence
        except ProcessLookupError:
            pass  # fenced (SIGKILL) and reaped: what should happen
    wait_for(lambda: worker(status(), 1)["pid"] != victim and worker(status(), 1)["healthy"],
             "the stopped worker to be fenced and replaced")
    assert_no_leaked_block()


def test_a_pool_without_workers_fails_requests_clearly(state_dir):
    served = ServedPool("--model", TINY_MODEL, "--workers", "1", "--pool-blocks", "256")
    endpoint = f"ipc://{served.runtime_dir}/admin.sock"
    try:
        with AdminClient(endpoint, timeout_s=10) as client:
            victim = client.status().workers[0]["pid"]
            executor = concurrent.futures.ThreadPoolExecutor(2)
            futures = [executor.submit(post, served, f"{i} {PROMPT}", 400) for i in range(2)]
            wait_for(lambda: client.status().stats["num_requests_running"], "requests to run")
            os.kill(victim, signal.SIGKILL)
            for future in futures:  # they end with an error, they do not hang
                response = future.result(timeout=WAIT_S)
                assert response.status_code == 500
                assert "no healthy worker can serve" in response.json()["error"]["message"]
            executor.shutdown()
            health = wait_for(lambda: (r := httpx.get(f"{served.base_url}/health")).status_code
                              == 503 and r, "/health to say 503")
            assert "pool 0 has no healthy worker" in health.json()["problems"]
            late = post(served, "hi", 2)
            assert late.status_code == 500 and "no healthy worker" in late.json()["error"]["message"]
            assert not client.status().healthy
        assert justapi("health", "--admin", endpoint).returncode == 1  # usable as a probe
    finally:
        served.children = child_pids(served.proc.pid)
        served.stop(signal.SIGTERM)
    assert served.leftovers() == []


def post(pool: ServedPool, prompt: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{pool.base_url}/v1/completions", timeout=WAIT_S * 2, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
