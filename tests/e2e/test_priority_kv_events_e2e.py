"""Priorities and KV events end to end through `justapi serve --scheduling-policy priority
--kv-events ... --kv-events-replay ...`: under a saturating load of priority-10 requests a
priority-0 request finishes before every one that was still queued; a router subscribed to
the event stream (caught up through the replay socket) holds exactly as many blocks as the
scheduler's prefix cache, including every prompt's full blocks under vLLM's hashes, and sees
them all removed by a flush; /metrics has the gauges llm-d's picker reads."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from justapi.scheduler.kv.events import BlockHasher, external_hash
from tools.kv_router import Subscriber
from tools.harness import TINY_MODEL, ServedPool, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BLOCK_SIZE = 16
NUM_BATCH = 6


def test_priority_overtakes_queued_batch_work_and_a_router_mirrors_the_cache():
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with ServedPool("--model", TINY_MODEL, "--scheduling-policy", "priority", "--max-seqs", "2",
                    "--pool-blocks", "400", "--block-size", str(BLOCK_SIZE), "--kv-events", pub,
                    "--kv-events-replay", replay, "--kv-events-hash-seed", "42",
                    "--log-level", "warning", private_state=True) as pool:
        router = Subscriber(pub, replay)
        try:
            router.catch_up(0)  # the AllBlocksCleared sent at start
            assert router.view.num_cleared == 1
            prompts, order, done_before = run_load(pool)
            # ahead of every request still queued: of those not done when it came, only the
            # (at most --max-seqs 2) running ones may finish before it
            assert done_before <= NUM_BATCH - 3, order  # some were still queued: a real test
            assert order.index("urgent") <= done_before + 2, (order, done_before)
            while router.poll(500):
                pass
            cached = pool.settled_metrics(["prefix_cache_blocks"])["prefix_cache_blocks"]
            while router.poll(500):
                pass
            blocks = router.view.blocks[0]
            assert len(blocks) == cached > 0
            hasher = BlockHasher("42")
            for tokens in prompts.values():
                chain = hasher.chain(None, tokens, BLOCK_SIZE)
                assert {external_hash(h) for h in chain} <= blocks
            flush = subprocess.run([sys.executable, "-m", "justapi.cli", "flush-cache"],
                                   capture_output=True, text=True, timeout=60)
            assert flush.returncode == 0, flush.stderr
            for _ in range(20):
                router.poll(500)
                if not router.view.blocks[0]:
                    break
            assert router.view.blocks[0] == set() and router.view.num_removed >= cached
            names = ["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
            assert set(pool.metrics(names)) == set(names)
            assert "vllm:lora_requests_info" in httpx.get(f"{pool.base_url}/metrics").text
        finally:
            router.close()


def run_load(pool: ServedPool) -> tuple[dict[str, list[int]], list[str], int]:
    """NUM_BATCH priority-10 requests, then (with them running or queued) one priority-0;
    returns the prompts, the order they finished in and how many had finished when the
    priority-0 one was sent."""
    order: list[str] = []
    lock = threading.Lock()
    prompts = {f"batch-{i}": [3 + i] * 8 + list(range(40, 72)) for i in range(NUM_BATCH)}
    prompts["urgent"] = [99] * 40

    def send(name: str, priority: int, max_tokens: int) -> None:
        reply = httpx.post(f"{pool.base_url}/v1/completions", timeout=300, json={
            "prompt": prompts[name], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "priority": priority})
        reply.raise_for_status()
        with lock:
            order.append(name)

    threads = [threading.Thread(target=send, args=(f"batch-{i}", 10, 512))
               for i in range(NUM_BATCH)]
    for thread in threads:
        thread.start()
    for _ in range(200):  # until the scheduler queues some of them
        if pool.metrics(["vllm:num_requests_waiting"])["vllm:num_requests_waiting"] >= 2:
            break
        time.sleep(0.1)
    with lock:
        done_before = len(order)
    urgent = threading.Thread(target=send, args=("urgent", 0, 4))
    urgent.start()
    for thread in [*threads, urgent]:
        thread.join()
    return prompts, order, done_before
