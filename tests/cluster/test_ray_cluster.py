"""`justapi serve --launcher ray` on a local Ray cluster whose nodes are network namespaces
(tools/netns_lab.py: veth pairs, private /30s), so the workers reach the scheduler only
through the veths, over tcp with CURVE: the openai client's greedy outputs equal the
single-host `--workers 2` run; traffic crosses the veths; /health and `justapi status` show
the hosts; a connection with a key the launcher did not authorize is refused; a prefix cached
on one host is copied to the other (KV over the wire) and not recomputed; a worker SIGKILLed
mid-load loses no request and Ray restarts it; a host cut off the network mid-load loses no
request, shows as lost (degraded), and its worker is fenced, restarted and taken back once it
is reachable; PD hands requests off between hosts by copy; nothing is left behind. Tiny
synthetic model.
Needs root for `ip netns` (skips without it)."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import zmq

from justapi.ops.admin_client import AdminClient
from justapi.wire import transport
from justapi.wire.auth import SERVER_KEY_FILE, read_key_file
from justapi.wire.protocol import Heartbeat, PoolInfo, Ready
from tools.harness import TINY_MODEL, ServedPool
from tools.netns_lab import NetnsLab, netns_available, process_tree, processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

COMMON = ("--model", TINY_MODEL, "--pool-blocks", "256", "--max-seqs", "16",
          "--chunk-size", "32", "--max-prefill", "1")
MODEL = "synthetic-llama-2x64-f32"
WAIT_S = 90.0  # upper bounds for a slow, shared machine: waits, not timing checks
PROMPTS = ["workers on other hosts", "reach the scheduler over tcp with CURVE keys",
           "one two three four five six seven eight nine ten " * 4, "the same answers?"]
PREFIX = "a system prompt long enough to fill several blocks of the KV cache, " * 3
IMPORTS = [PREFIX + "first question", PREFIX + "second question"]
LOAD = [f"load {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)
        for i in range(8)]
LOAD_TOKENS = 48


def greedy(pool: ServedPool, prompt: str, max_tokens: int = 24) -> tuple[str, int]:
    """(text, cached prompt tokens) of a greedy completion."""
    client = openai.OpenAI(base_url=f"{pool.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=WAIT_S * 2)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
    details = out.usage.prompt_tokens_details
    return out.choices[0].text, int(details.cached_tokens or 0) if details else 0


def admin(pool: ServedPool) -> AdminClient:
    return AdminClient(f"ipc://{pool.runtime_dir}/admin.sock", timeout_s=10)


def status(pool: ServedPool):
    with admin(pool) as connection:
        return connection.status()


def wait_for(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def load_until_running(pool: ServedPool, executor, worker_id: int) -> dict:
    """Submits LOAD and returns its futures once worker `worker_id` runs some of them. A round
    that ends before the worker is seen running (a fast host) is checked and submitted again,
    so the caller's fault always lands mid-load."""
    key = f"worker_{worker_id}_num_requests_running"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        futures = {p: executor.submit(greedy, pool, p, LOAD_TOKENS) for p in LOAD}
        while not all(f.done() for f in futures.values()):
            if status(pool).stats.get(key, 0) > 0:
                return futures
            time.sleep(0.05)
        for future in futures.values():
            future.result()  # a round that failed fails here, with its own error
    raise AssertionError(f"timed out waiting for worker {worker_id} to run requests")


def ray_config(lab: NetnsLab, more: str) -> str:
    """TOML for a pool on the lab: one worker per host (strict_spread), 1 CPU each."""
    return (f'launcher = "ray"\naddress = "{lab.address}"\nnode-ip = "{lab.head_ip}"\n'
            f'placement = "strict_spread"\ncpus-per-worker = 1\n{more}')


def kv_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("justapi-kv-")}


def actor_processes(lab: NetnsLab) -> list[int]:
    """Our actors' processes still alive in the lab (Ray names them ray::<Class>...)."""
    table = processes()
    return [pid for pid in process_tree(lab.temp_dir) if pid in table
            and table[pid][1].startswith(("ray::WorkerActor", "ray::HostPoolActor"))]


@pytest.fixture(scope="module")
def lab():
    why = netns_available()
    if why:
        pytest.skip(f"a lab of network namespaces cannot be built here: {why}")
    built = NetnsLab(num_hosts=2, cpus=2.0).up()  # room for the PD pool beside the other
    yield built
    built.down()


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("state"))
    old = os.environ.get("JUSTAPI_STATE_DIR")
    os.environ["JUSTAPI_STATE_DIR"] = path
    yield path
    if old is None:
        del os.environ["JUSTAPI_STATE_DIR"]
    else:
        os.environ["JUSTAPI_STATE_DIR"] = old


@pytest.fixture(scope="module")
def served(lab, state_dir, tmp_path_factory):
    """The ray pool and the single-host reference, started side by side; the reference's
    outputs are taken, and it is stopped, before any test runs."""
    config = tmp_path_factory.mktemp("ray") / "ray.toml"
    config.write_text(ray_config(lab, 'workers = 2\nrestart-workers = true\n'))
    segments_before = kv_segments()
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        ray_future = executor.submit(ServedPool, *COMMON, "--config", str(config))
        local_future = executor.submit(ServedPool, *COMMON, "--workers", "2")
        local = local_future.result()
        try:
            reference = {p: greedy(local, p)[0] for p in PROMPTS + IMPORTS}
            reference.update({p: greedy(local, p, LOAD_TOKENS)[0] for p in LOAD})
        finally:
            assert local.stop() == 0, local.log()
        pool = ray_future.result()
    yield pool, reference
    assert pool.stop(signal.SIGTERM) == 0, pool.log()
    assert pool.leftovers() == [], pool.log()
    wait_for(lambda: not actor_processes(lab), f"the actors to exit:\n{pool.log()[-3000:]}", 60)
    wait_for(lambda: kv_segments() <= segments_before,  # (a killed owner's tracker unlinks)
             f"the hosts' KV segments to go: {kv_segments() - segments_before}", 30)


def test_outputs_equal_the_single_host_run_over_the_veths(served, lab):
    pool, reference = served
    before = lab.veth_bytes()
    for prompt in PROMPTS:
        assert greedy(pool, prompt)[0] == reference[prompt], prompt
    assert lab.veth_bytes() - before > 20_000, "the steps did not cross the veth pairs"
    workers = status(pool).workers
    assert sorted(w["host"] for w in workers) == sorted(h.inside_ip for h in lab.hosts)
    assert len({w["pool_id"] for w in workers}) == 2  # a KV pool per host


def test_health_and_status_show_the_hosts(served, lab):
    pool, _ = served
    body = httpx.get(f"{pool.base_url}/health", timeout=10).json()
    assert body["status"] == "ok"
    assert sorted(h["host"] for h in body["hosts"]) == sorted(h.inside_ip for h in lab.hosts)
    assert all(h["num_workers"] == h["num_workers_healthy"] == 1 for h in body["hosts"])
    result = subprocess.run([sys.executable, "-m", "justapi.cli", "status", "--admin",
                             f"ipc://{pool.runtime_dir}/admin.sock"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    hosts = result.stdout.split("\nhosts\n", 1)[1].split("\n\n", 1)[0]
    for host in lab.hosts:
        assert host.inside_ip in hosts


def test_a_key_the_launcher_did_not_authorize_is_refused(served):
    pool, _ = served
    endpoint = next(line.split("connect to ", 1)[1].split()[0] for line in pool.log().splitlines()
                    if "workers connect to tcp://" in line)
    server_key = zmq.curve_public(read_key_file(os.path.join(pool.runtime_dir, SERVER_KEY_FILE)))
    before = {w["worker_id"]: w["pid"] for w in status(pool).workers}
    context = zmq.Context()
    intruder = transport.make_socket(context, zmq.DEALER, endpoint, bind=False,
                                     identity=b"worker-0", curve_server_key=server_key)
    intruder.setsockopt(zmq.SNDTIMEO, 2000)
    fake_pool = PoolInfo(0, "shm", "fake", "cpu", "float32", 2, 256, 16, 2, 16, "10.9.9.9")
    try:
        transport.send(intruder, Ready(0, 4242, MODEL, 512, 1024, fake_pool))
        transport.send(intruder, Heartbeat(0, time.time()))
    except zmq.Again:
        pass  # not even queued: the handshake never completed
    wait_for(lambda: "refused a worker connection" in pool.log(), "the ZAP refusal in the log")
    time.sleep(1.0)
    intruder.close(0)
    context.term()
    after = status(pool)
    assert {w["worker_id"]: w["pid"] for w in after.workers} == before
    assert all(w["healthy"] for w in after.workers) and "10.9.9.9" not in str(after.workers)
    assert greedy(pool, PROMPTS[0])[0]  # still serving


def test_a_prefix_cached_on_one_host_is_copied_to_the_other(served):
    pool, reference = served
    assert greedy(pool, IMPORTS[0])[0] == reference[IMPORTS[0]]
    stats = status(pool).stats
    holder = max((0, 1), key=lambda p: stats.get(f"pool_{p}_prefix_cache_blocks", 0))
    worker = next(w["worker_id"] for w in status(pool).workers if w["pool_id"] == holder)
    with admin(pool) as connection:
        connection.drain(worker)  # the next request goes to the other host
        try:
            text, cached = greedy(pool, IMPORTS[1])
        finally:
            connection.drain(worker, is_draining=False)
        check = connection.check_invariants()
    assert text == reference[IMPORTS[1]]
    after = status(pool).stats
    assert after["kv_imports"] == 1 and after["kv_import_failures"] == 0, after
    assert after["kv_import_bytes"] > 0 and cached >= 48, "the prefix was recomputed"
    assert after[f"pool_{1 - holder}_prefix_cache_blocks"] > 0
    assert check.ok, check.message


def test_a_worker_killed_mid_load_loses_no_request_and_ray_restarts_it(served):
    pool, reference = served
    victim = next(w for w in status(pool).workers if w["worker_id"] == 1)
    with concurrent.futures.ThreadPoolExecutor(len(LOAD)) as executor:
        futures = load_until_running(pool, executor, 1)
        os.kill(victim["pid"], signal.SIGKILL)
        outputs = {p: f.result(timeout=WAIT_S * 2)[0] for p, f in futures.items()}
    assert outputs == {p: reference[p] for p in LOAD}
    rejoined = wait_for(lambda: next((w for w in status(pool).workers if w["worker_id"] == 1
                                      and w["healthy"] and w["pid"] != victim["pid"]), None),
                        "Ray to restart worker 1 and the scheduler to take it back", 120)
    assert rejoined["num_restarts"] == 1 and rejoined["host"] == victim["host"]
    assert "worker 1 (pid" in pool.log() and "Ray restarts it" in pool.log()
    assert greedy(pool, PROMPTS[1])[0] == reference[PROMPTS[1]]
    with admin(pool) as connection:
        assert connection.check_invariants().ok
    assert status(pool).stats["kv_blocks_in_use"] == 0


def test_a_host_cut_off_mid_load_loses_no_request_and_comes_back(served, lab):
    pool, reference = served
    victim = next(w for w in status(pool).workers if w["worker_id"] == 0)
    host = next(h for h in lab.hosts if h.inside_ip == victim["host"])
    with concurrent.futures.ThreadPoolExecutor(len(LOAD)) as executor:
        futures = load_until_running(pool, executor, 0)
        lab.set_link(host, is_up=False)
        try:
            outputs = {p: f.result(timeout=WAIT_S * 2)[0] for p, f in futures.items()}
            body = wait_for(lambda: _degraded(pool, host.inside_ip), "/health to report the host")
            table = subprocess.run([sys.executable, "-m", "justapi.cli", "status", "--admin",
                                    f"ipc://{pool.runtime_dir}/admin.sock"],
                                   capture_output=True, text=True, timeout=60).stdout
        finally:
            lab.set_link(host, is_up=True)  # before Ray's own health checks give the node up
    assert outputs == {p: reference[p] for p in LOAD}
    assert {h["host"]: h["num_workers_healthy"] for h in body["hosts"]}[host.inside_ip] == 0
    assert next(line for line in table.splitlines() if line.startswith(host.inside_ip)) \
        .split()[-1] == "LOST"
    wait_for(lambda: next((w for w in status(pool).workers if w["worker_id"] == 0
                           and w["healthy"] and w["pid"] != victim["pid"]), None),
             "the cut-off worker to be fenced, restarted by Ray and taken back", 120)
    wait_for(lambda: httpx.get(f"{pool.base_url}/health", timeout=10).json()["status"] == "ok",
             "/health to be ok again")
    assert greedy(pool, PROMPTS[2])[0] == reference[PROMPTS[2]]


def _degraded(pool: ServedPool, host: str) -> dict | None:
    body = httpx.get(f"{pool.base_url}/health", timeout=10).json()
    lost = f"host {host} lost: none of its 1 worker(s) is healthy"
    return body if body["status"] == "degraded" and lost in body["warnings"] else None


def test_pd_hands_off_between_hosts_by_copy(served, lab, tmp_path):
    _, reference = served
    config = tmp_path / "pd.toml"
    config.write_text(ray_config(lab, 'pd = "1:1"\n'))
    segments = kv_segments()
    pd = ServedPool(*COMMON, "--config", str(config))
    try:
        # both sides up first: while one side has no healthy worker the other serves colocated
        # (by design), and the server can be ready before the other host's worker has joined
        wait_for(lambda: {w["role"] for w in status(pd).workers if w["healthy"]} == {"prefill", "decode"},
                 "a healthy prefill and decode worker")
        for prompt in PROMPTS:
            assert greedy(pd, prompt)[0] == reference[prompt], prompt
        after = status(pd)
        hosts = {w["role"]: w["host"] for w in after.workers}
        assert hosts["prefill"] != hosts["decode"]
        assert after.stats["pd_num_copies"] == len(PROMPTS)  # every hand-off crossed hosts
        assert after.stats["pd_num_copy_errors"] == 0 and after.stats["pd_copied_bytes"] > 0
        with admin(pd) as connection:
            assert connection.check_invariants().ok
    finally:
        assert pd.stop() == 0, pd.log()
    assert pd.leftovers() == [], pd.log()
    wait_for(lambda: kv_segments() <= segments, "the PD pool's KV segments to go", 30)
