"""The 2026 API's costs and gains, each part in one run with its baseline beside it:

  embed      /v1/embeddings per second at batch 1 (one input per request, one at a time)
             and batch 64 (64 inputs per request) against llama-server's on the same GGUF
             (--embedding --pooling last), servers measured in turns; also the cosine
             between the two servers' vectors of the same inputs
  priority   TTFT p50 of priority-0 probes under a saturating load of priority-10 streams:
             --scheduling-policy priority vs fcfs (the same probes without a priority)
  kv-events  the shared-prefix workload with and without --kv-events (a subscriber
             attached), in turns; and the events' CPU time per stored block, in-process,
             times the blocks the run stored, over the run's time

    python -m tools.bench api-2026 embed --llama-server PATH/llama-server
    python -m tools.bench api-2026 priority
    python -m tools.bench api-2026 kv-events

The machine is shared and noisy: only ratios within one run mean anything.
Owns: these scenarios. Does not own: the load generator (justapi bench serve).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
from typing import Any

import httpx
import numpy as np

from tools.bench.serve import run_bench
from tools.harness import ServedPool, free_port

PROG = "python -m tools.bench api-2026"
WORDS = ("river stone market lantern orchard signal harbor meadow copper violet thunder "
         "canvas pepper saddle glacier").split()


def texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"Note {i}: " + " ".join(rng.choice(WORDS, 20)) for i in range(count)]


# ------------------------------------------------------------------ embed
class LlamaServer:
    def __init__(self, binary: str, model: str, threads: int, parallel: int,
                 poll: int = 0) -> None:
        """poll: llama.cpp's --poll (its threads' busy-wait level; 50 by default). 0: they
        sleep while waiting, as ours do - on a shared machine a spinning thread takes the
        core another process needs, and the comparison would measure that instead."""
        self.poll = poll
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [binary, "-m", model, "--embedding", "--pooling", "last", "--port", str(self.port),
             "-t", str(threads), "-np", str(parallel), "-c", str(parallel * 256), "-b", "4096",
             "-ub", "4096", "--poll", str(self.poll), "--log-disable"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise SystemExit(f"{PROG}: llama-server did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def embed_rate(url: str, inputs: list[str], batch: int) -> tuple[float, list[list[float]]]:
    """Embeddings per second sending `batch` inputs per request, one request at a time."""
    vectors: list[list[float]] = []
    with httpx.Client(timeout=600) as client:
        client.post(f"{url}/v1/embeddings", json={"input": inputs[:batch]}).raise_for_status()
        start = time.perf_counter()
        for lo in range(0, len(inputs), batch):
            reply = client.post(f"{url}/v1/embeddings", json={"input": inputs[lo:lo + batch]})
            reply.raise_for_status()
            vectors += [d["embedding"] for d in sorted(reply.json()["data"],
                                                       key=lambda d: d["index"])]
        return len(inputs) / (time.perf_counter() - start), vectors


def embed(args: argparse.Namespace) -> None:
    from justapi.model.gguf_file import default_model_path
    model = args.model or default_model_path()
    ours = ServedPool("--model", model, "--pooling", "last", "--max-seqs", "64",
                      "--max-prefill", "64", "--threads", str(args.threads),
                      "--log-level", "warning")
    theirs = LlamaServer(args.llama_server, model, args.threads, 64, args.poll)
    rows: dict[str, dict[int, list[float]]] = {"justapi": {1: [], 64: []},
                                               "llama-server": {1: [], 64: []}}
    cosines: list[float] = []
    try:
        for turn in range(args.turns):
            for batch, count in ((1, args.batch1_inputs), (64, 64 * args.batch64_requests)):
                inputs = texts(count, seed=turn * 100 + batch)
                a, va = embed_rate(ours.base_url, inputs, batch)
                b, vb = embed_rate(theirs.url, inputs, batch)
                rows["justapi"][batch].append(a)
                rows["llama-server"][batch].append(b)
                print(f"turn {turn} batch {batch}: justapi {a:.1f} emb/s, llama-server "
                      f"{b:.1f} emb/s", flush=True)
                cosines += [float(np.dot(x, y) / np.linalg.norm(x) / np.linalg.norm(y))
                            for x, y in zip(va, vb)]
    finally:
        ours.stop()
        theirs.stop()
    print(f"\n## /v1/embeddings, {model} (last pooling), {args.threads} thread(s) each, "
          f"best of {args.turns} turns")
    print(f"{'server':<14} {'batch 1 emb/s':>14} {'batch 64 emb/s':>15}")
    for name, by_batch in rows.items():
        print(f"{name:<14} {max(by_batch[1]):>14.1f} {max(by_batch[64]):>15.1f}")
    for batch in (1, 64):
        print(f"ratio justapi / llama-server at batch {batch}: "
              f"{max(rows['justapi'][batch]) / max(rows['llama-server'][batch]):.2f}x")
    print(f"cosine(justapi, llama-server) over {len(cosines)} vectors: min {min(cosines):.5f}, "
          f"median {statistics.median(cosines):.5f}")


# ------------------------------------------------------------------ priority
def ttft_s(url: str, prompt: str, priority: int | None) -> float:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                            "stream": True, "ignore_eos": True}
    if priority is not None:
        body["priority"] = priority
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start  # (closing the stream aborts the rest)
    raise RuntimeError("no token")


def probe_under_load(policy: str, args: argparse.Namespace) -> list[float]:
    stop = threading.Event()
    with ServedPool("--model", args.model or "", "--scheduling-policy", policy, "--max-seqs",
                    str(args.max_seqs), "--log-level", "warning") as pool:
        def batch_stream(i: int) -> None:
            body: dict[str, Any] = {"prompt": f"Batch job {i}: " + " ".join(WORDS) * 4,
                                    "max_tokens": 96, "temperature": 0, "ignore_eos": True}
            if policy == "priority":
                body["priority"] = 10
            while not stop.is_set():
                try:
                    httpx.post(f"{pool.base_url}/v1/completions", json=body, timeout=600)
                except httpx.HTTPError:
                    return  # the server stopped
        load = [threading.Thread(target=batch_stream, args=(i,), daemon=True)
                for i in range(args.max_seqs * 3)]
        for thread in load:
            thread.start()
        time.sleep(args.warmup_s)
        samples = []
        for i, prompt in enumerate(texts(args.probes, seed=7)):
            samples.append(ttft_s(pool.base_url, prompt, 0 if policy == "priority" else None))
            print(f"{policy} probe {i}: TTFT {samples[-1]:.3f} s", flush=True)
            time.sleep(0.5)
        stop.set()
    return samples


def priority(args: argparse.Namespace) -> None:
    rows = {policy: probe_under_load(policy, args) for policy in ("priority", "fcfs")}
    print(f"\n## TTFT of interactive probes under {args.max_seqs * 3} saturating batch streams "
          f"(max-seqs {args.max_seqs})")
    for policy, samples in rows.items():
        print(f"{policy:<10} TTFT p50 {statistics.median(samples):.3f} s  max {max(samples):.3f} s "
              f"({len(samples)} probes)")
    print(f"ratio fcfs / priority (p50): "
          f"{statistics.median(rows['fcfs']) / statistics.median(rows['priority']):.1f}x")


# ------------------------------------------------------------------ kv-events
def kv_events(args: argparse.Namespace) -> None:
    from tools.kv_router import Subscriber

    bench = ["--workload", "shared-prefix", "--ignore-eos", "--num-requests",
             str(args.num_requests), "--max-tokens", "16"]
    common = ["--model", args.model or "", "--log-level", "warning"]
    rows: dict[str, list[float]] = {"off": [], "on": []}
    stored = 0
    duration = 0.0
    for _ in range(args.turns):
        with ServedPool(*common) as pool:
            rows["off"].append(run_bench(pool.base_url, bench)["summary"]["output_throughput"])
        pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        with ServedPool(*common, "--kv-events", pub, "--kv-events-replay", replay) as pool:
            router = Subscriber(pub, replay)
            start = time.perf_counter()
            summary = run_bench(pool.base_url, bench)["summary"]
            duration += time.perf_counter() - start
            rows["on"].append(summary["output_throughput"])
            print(f"turn: off {rows['off'][-1]:.1f}, on {rows['on'][-1]:.1f} output tok/s",
                  flush=True)
            router.catch_up(0)
            router.poll(500)
            stored += router.view.num_stored + router.view.num_removed
            router.close()
    per_block_s = event_cost_per_block()
    print(f"\n## shared-prefix workload, {args.num_requests} requests, {args.turns} turns each")
    for name, values in rows.items():
        print(f"--kv-events {name:<4} output tok/s {', '.join(f'{v:.1f}' for v in values)}")
    print(f"ratio on / off (best of each): {max(rows['on']) / max(rows['off']):.3f}")
    print(f"events: {stored} blocks stored or removed in {duration:.1f} s of load; "
          f"{per_block_s * 1e6:.1f} us of scheduler CPU per block -> "
          f"{100 * stored * per_block_s / duration:.3f}% of the run (target < 2%)")


def event_cost_per_block() -> float:
    """Hashing a stored 16-token block, its event, and its share of a batch's msgpack."""
    import msgpack

    from justapi.scheduler.kv.events import KvEventLog
    log = KvEventLog(16, "0", {0: "CPU"})
    tokens = list(range(1000, 1000 + 16 * 32))
    start = time.perf_counter()
    rounds = 200
    for r in range(rounds):
        log.stored(0, None, list(range(r * 32, r * 32 + 32)), tokens, "")
        for _, events in log.take():
            msgpack.packb([0.0, events, 0], use_bin_type=True)
        log.removed(0, list(range(r * 32, r * 32 + 32)))
        log.take()
    return (time.perf_counter() - start) / (rounds * 32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("embed", "priority", "kv-events"))
    parser.add_argument("--model", default="", help="GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--llama-server", default="", help="embed: llama-server's binary")
    parser.add_argument("--threads", type=int, default=2,
                        help="embed: each server's compute threads (ours: --threads, "
                             "llama-server: -t); 1 on a loaded machine, where two threads "
                             "meeting at a barrier wait for a descheduled one at every op")
    parser.add_argument("--poll", type=int, default=0, help="embed: llama-server --poll")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--batch1-inputs", type=int, default=32)
    parser.add_argument("--batch64-requests", type=int, default=3)
    parser.add_argument("--max-seqs", type=int, default=4, help="priority: the server's")
    parser.add_argument("--probes", type=int, default=8, help="priority: interactive probes")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--num-requests", type=int, default=32, help="kv-events")
    args = parser.parse_args(argv)
    if args.part == "embed" and not args.llama_server:
        parser.error("embed needs --llama-server")
    {"embed": embed, "priority": priority, "kv-events": kv_events}[args.part](args)
