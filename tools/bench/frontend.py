"""Control-plane throughput of the frontend alone: how many tokens/s it streams to N clients.

Three processes: a stand-in scheduler that answers every SubmitRequest with one token per
request per step (no model; one TokenDeltas per step, like the real scheduler), the real
frontend (FrontendServer: uvicorn + ZMQ endpoint, SmolLM2's tokenizer, incremental
detokenization, metrics), and this process as N streaming clients (a lean HTTP/1.1 SSE
reader, or justapi.client.AsyncClient with --api zmq). Prints tokens/s delivered, events/s,
tokens per event (coalescing), client-side inter-event latency and the frontend's CPU use.

    python -m tools.bench frontend [--clients 64] [--max-tokens 256] [--rounds 2]
                                   [--api http|zmq] [--step-ms 0] [--stop-string]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import orjson
import zmq

from justapi.wire import transport
from justapi.wire.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    AbortRequest,
    SchedulerStats,
    SubmitRequest,
    TokenDeltas,
)

TEXT = " The quick brown fox jumps over the lazy dog, and the cat sleeps in the sun."


# ------------------------------------------------------------------ stand-in scheduler
def run_scheduler(inbox_endpoint: str, outbox_endpoint: str, token_ids: list[int],
                  step_s: float) -> None:
    context = zmq.Context()
    inbox = transport.make_socket(context, zmq.PULL, inbox_endpoint, bind=True)
    outbox = transport.make_socket(context, zmq.PUSH, outbox_endpoint, bind=False)
    running: dict[str, list[int]] = {}  # request id -> [num_emitted, max_tokens]
    last_stats = 0.0
    while True:
        if inbox.poll(0 if running else 100):
            for _, message in transport.drain(inbox):
                if isinstance(message, SubmitRequest):
                    running[message.request_id] = [0, message.sampling.max_tokens]
                elif isinstance(message, AbortRequest):
                    _abort(outbox, running, message.request_ids)
        if running:
            _step(outbox, running, token_ids)
            if step_s:
                time.sleep(step_s)
        if time.monotonic() - last_stats > 0.5:
            last_stats = time.monotonic()
            transport.send(outbox, SchedulerStats(time.time(), True, {
                "num_requests_running": len(running)}, [], []))


def _step(outbox: zmq.Socket, running: dict[str, list[int]], token_ids: list[int]) -> None:
    request_ids = list(running)
    tokens, reasons = [], []
    for request_id in request_ids:
        state = running[request_id]
        tokens.append(token_ids[state[0] % len(token_ids)])
        state[0] += 1
        finished = state[0] >= state[1]
        reasons.append(FINISH_LENGTH if finished else "")
        if finished:
            del running[request_id]
    n = len(request_ids)
    transport.send(outbox, TokenDeltas(0, request_ids, np.ones(n, np.int32),
                                       np.asarray(tokens, np.int32), reasons))


def _abort(outbox: zmq.Socket, running: dict, request_ids: list[str]) -> None:
    gone = [r for r in request_ids if running.pop(r, None) is not None]
    if gone:
        transport.send(outbox, TokenDeltas(0, gone, np.zeros(len(gone), np.int32),
                                           np.zeros(0, np.int32), [FINISH_ABORT] * len(gone)))


# ------------------------------------------------------------------ the frontend under test
def run_frontend(settings_dict: dict, ready: mp.Queue) -> None:
    import uvloop

    from justapi.frontend.engine_client import EngineClient
    from justapi.frontend.server import FrontendServer, FrontendSettings, build_serving
    from justapi.model.gguf_file import GGUFFile, default_model_path

    async def main() -> None:
        settings = FrontendSettings(**settings_dict)
        engine = EngineClient(settings.scheduler_endpoint, settings.frontend_endpoint)
        await engine.start()
        server = FrontendServer(build_serving(GGUFFile(default_model_path()), engine, settings),
                                settings)
        await server.start()
        ready.put(server.http_url)
        await server.wait()

    uvloop.run(main())


# ------------------------------------------------------------------ clients
async def http_stream(host: str, port: int, body: bytes) -> tuple[int, list[float]]:
    """One streaming request over a raw HTTP/1.1 connection -> (tokens, event arrival times)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    pending, times, num_tokens = b"", [], 0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.strip(), 16)
        if size == 0:
            break
        pending += await reader.readexactly(size + 2)
        pending = pending[:-2] if pending.endswith(b"\r\n") else pending
        now = time.perf_counter()
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event == b"data: [DONE]":
                continue
            payload = orjson.loads(event[6:])
            if payload.get("usage"):
                num_tokens = payload["usage"]["completion_tokens"]
            elif payload["choices"]:
                times.append(now)
    writer.close()
    return num_tokens, times


async def zmq_stream(client, max_tokens: int, stop: list[str]) -> tuple[int, list[float]]:
    times, num_tokens = [], 0
    async for chunk in client.generate("bench", max_tokens=max_tokens, stop=stop):
        times.append(time.perf_counter())
        num_tokens += len(chunk.token_ids)
    return num_tokens, times


async def drive(args: argparse.Namespace, http_url: str, zmq_endpoint: str) -> dict:
    from justapi.client import AsyncClient

    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    stop = ["never appears"] if args.stop_string else []
    body = orjson.dumps({"prompt": "bench", "max_tokens": args.max_tokens, "stream": True,
                         "stop": stop or None, "stream_options": {"include_usage": True}})
    zmq_client = AsyncClient(zmq_endpoint) if args.api == "zmq" else None

    async def one_client() -> list[tuple[int, list[float]]]:
        out = []
        for _ in range(args.rounds):
            if zmq_client is not None:
                out.append(await zmq_stream(zmq_client, args.max_tokens, stop))
            else:
                out.append(await http_stream(host, int(port), body))
        return out

    start = time.perf_counter()
    results = await asyncio.gather(*(one_client() for _ in range(args.clients)))
    elapsed = time.perf_counter() - start
    if zmq_client is not None:
        await zmq_client.close()
    streams = [r for client in results for r in client]
    gaps = [b - a for _, times in streams for a, b in zip(times, times[1:])]
    num_tokens = sum(n for n, _ in streams)
    num_events = sum(len(t) for _, t in streams)
    return {"elapsed_s": elapsed, "tokens": num_tokens, "events": num_events,
            "gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
            "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else float("nan")}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench frontend",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client, in a row")
    parser.add_argument("--api", choices=("http", "zmq"), default="http")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="pause of the stand-in scheduler after each step (0: flat out)")
    parser.add_argument("--stop-string", action="store_true",
                        help="send a stop string (token-by-token text path)")
    args = parser.parse_args(argv)

    from justapi.frontend.text.tokenizer import Tokenizer
    from justapi.model.gguf_file import GGUFFile, default_model_path
    token_ids = Tokenizer.from_gguf(GGUFFile(default_model_path())).encode(
        TEXT, add_special_tokens=False)
    runtime_dir = transport.make_runtime_dir("justapi-bench-")
    endpoints = {name: transport.ipc_endpoint(runtime_dir, name)
                 for name in ("scheduler", "frontend", "client")}
    spawn = mp.get_context("spawn")
    scheduler = spawn.Process(target=run_scheduler, daemon=True, args=(
        endpoints["scheduler"], endpoints["frontend"], token_ids, args.step_ms / 1e3))
    ready: mp.Queue = spawn.Queue()
    frontend = spawn.Process(target=run_frontend, daemon=True, args=({
        "scheduler_endpoint": endpoints["scheduler"], "frontend_endpoint": endpoints["frontend"],
        "zmq_endpoint": endpoints["client"], "model_name": "bench", "port": 0,
        "log_level": "warning"}, ready))
    scheduler.start()
    frontend.start()
    try:
        http_url = ready.get(timeout=120)
        assert frontend.pid is not None  # started above
        cpu_before = cpu_seconds(frontend.pid)
        figures = asyncio.run(drive(args, http_url, endpoints["client"]))
        cpu = cpu_seconds(frontend.pid) - cpu_before
    finally:
        for process in (frontend, scheduler):
            process.terminate()
            process.join(5)
        transport.remove_runtime_dir(runtime_dir)
    seconds = figures["elapsed_s"]
    print(f"api={args.api} clients={args.clients} max_tokens={args.max_tokens} "
          f"rounds={args.rounds} step_ms={args.step_ms} stop_string={args.stop_string}")
    print(f"  tokens delivered     {figures['tokens']:>10,d} in {seconds:.2f} s "
          f"= {figures['tokens'] / seconds:,.0f} tokens/s")
    print(f"  stream events        {figures['events']:>10,d} = {figures['events'] / seconds:,.0f}"
          f" events/s, {figures['tokens'] / max(1, figures['events']):.2f} tokens/event")
    print(f"  inter-event gap      p50 {figures['gap_p50_ms']:.2f} ms, "
          f"p99 {figures['gap_p99_ms']:.2f} ms")
    print(f"  frontend CPU         {cpu:.2f} s = {cpu / seconds:.0%} of one core, "
          f"{1e6 * cpu / max(1, figures['tokens']):.1f} us per token")


if __name__ == "__main__":
    main()
