"""Cross-host KV hand-off cost, measured between network namespaces on this machine.

Builds a two-host lab (tools/netns_lab.py: each host a network namespace behind a veth pair,
running a Ray node), serves `--launcher ray --pd 1:1` with the prefill worker on one host and
the decode worker on the other, and sends prompts of several lengths one at a time: each
request's KV goes from host A's pool to host B's over the wire (prefill-host worker ->
scheduler -> decode worker, CURVE-encrypted tcp over the veths) before it decodes. Baseline:
the same on one host with `--pd-separate-pools` (the decode worker copies from the other
segment in memory). Per prompt length it prints the KV handed off per request, the mean
hand-off latency (prefill step returned -> claimed by a decode worker, copy included), the
throughput that implies, the prefill time (time to first token) and the hand-off as a
fraction of it - what `cross-host-copy-cost` stands for (docs/scale-out.md). Needs root.

    python -m tools.bench cross-host                       # SmolLM2, 128/512/1536 tokens
    python -m tools.bench cross-host --lengths 256,1024 --requests 5 --no-baseline

Owns: the runs and the table. Does not own: the servers (justapi serve), the lab.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from justapi.model.gguf_file import GGUFFile
from justapi.model.info import ModelInfo, resolve_model
from tools.bench.pd import PD_METRICS
from tools.harness import ServedPool
from tools.netns_lab import NetnsLab, netns_available

PROG = "python -m tools.bench cross-host"
DEFAULT_LENGTHS = "128,512,1536"
STATS_WAIT_S = 10.0
DECODE_TOKENS = 128
VOCAB_FLOOR = 300  # random prompt ids start above the special tokens


def run(serve_args: list[str], lengths: list[int], requests: int, vocab: int,
        lab: NetnsLab | None = None) -> dict[Any, dict[str, float]]:
    """Per prompt length: hand-off latency, bytes copied and prefill time, from one server;
    with the lab, also the traffic of a decode (key "decode")."""
    with ServedPool("--log-level", "warning", *serve_args) as server:
        _request(server.base_url, _prompt(32, vocab))  # warm-up (the first steps pay for set-up)
        _settled(server, {}, 1)  # its hand-off counted before the first measurement starts
        out: dict[Any, dict[str, float]] = {n: _measure(server, n, requests, vocab)
                                            for n in lengths}
        if lab is not None:
            out["decode"] = _decode_traffic(server, lab, vocab)
        return out


def _decode_traffic(server: ServedPool, lab: NetnsLab, vocab: int) -> dict[str, float]:
    """Bytes on the veths per decode step of one stream, its hand-off's copy taken out (the
    relay carries it twice: in from the prefill host, out to the decode host)."""
    before, veth = server.metrics(PD_METRICS), lab.veth_bytes()
    _request(server.base_url, _prompt(32, vocab), DECODE_TOKENS)
    after = _settled(server, before, 1)
    name = "justapi:pd_copied_bytes_total"
    copied = after.get(name, 0.0) - before.get(name, 0.0)
    return {"bytes_per_step": (lab.veth_bytes() - veth - 2 * copied) / DECODE_TOKENS}


def _measure(server: ServedPool, num_tokens: int, requests: int, vocab: int) -> dict[str, float]:
    before = server.metrics(PD_METRICS)
    ttfts = [_request(server.base_url, _prompt(num_tokens, vocab)) for _ in range(requests)]
    after = _settled(server, before, requests)

    def delta(name: str) -> float:
        return after.get(f"justapi:{name}", 0.0) - before.get(f"justapi:{name}", 0.0)

    count = max(1.0, delta("pd_handoff_latency_seconds_count"))
    return {"handoffs": delta("pd_handoffs_total"),
            "handoff_s": delta("pd_handoff_latency_seconds_sum") / count,
            "bytes": delta("pd_handoff_bytes_total") / max(1.0, delta("pd_handoffs_total")),
            "copied_bytes": delta("pd_copied_bytes_total"),
            "prefill_s": sorted(ttfts)[len(ttfts) // 2]}


def _settled(server: ServedPool, before: dict[str, float], requests: int) -> dict[str, float]:
    """/metrics once the scheduler's snapshot (pushed every 0.5 s) counts every hand-off."""
    name = "justapi:pd_handoffs_total"
    deadline = time.monotonic() + STATS_WAIT_S
    while True:
        after = server.metrics(PD_METRICS)
        if after.get(name, 0.0) - before.get(name, 0.0) >= requests or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def _prompt(num_tokens: int, vocab: int) -> list[int]:
    """Distinct random ids: no prefix of it is cached on either side."""
    return [random.randrange(VOCAB_FLOOR, vocab) for _ in range(num_tokens)]


def _request(url: str, prompt: list[int], max_tokens: int = 2) -> float:
    """Stream max_tokens (all but the first decoded after the hand-off); the time to the first."""
    body = {"model": _model(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.monotonic()
    first = 0.0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and not first:
                first = time.monotonic() - start
    return first


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def vocab_size(model: str) -> int:
    return ModelInfo.from_gguf(GGUFFile(resolve_model(model))).vocab_size


def render(lengths: list[int], cross: dict, local: dict | None) -> str:
    header = (f"{'prompt':>7} {'KV MiB':>8} {'cross-host ms':>14} {'MB/s':>7} {'prefill ms':>11} "
              f"{'copy/prefill':>13}")
    if local:
        header += f" {'one-host copy ms':>17} {'MB/s':>7}"
    lines = [header]
    for n in lengths:
        row = cross[n]
        mib = row["bytes"] / 2**20
        line = (f"{n:>7} {mib:>8.1f} {row['handoff_s'] * 1e3:>14.1f} "
                f"{_rate(row['bytes'], row['handoff_s']):>7.0f} {row['prefill_s'] * 1e3:>11.0f} "
                f"{row['handoff_s'] / max(row['prefill_s'], 1e-9):>13.3f}")
        if local:
            base = local[n]
            rate = _rate(base["bytes"], base["handoff_s"])
            line += f" {base['handoff_s'] * 1e3:>17.1f} {rate:>7.0f}"
        lines.append(line)
    return "\n".join(lines)


def _rate(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e6 if seconds > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    cli.add_argument("--model", default="", help="GGUF or synthetic:SPEC (default: SmolLM2)")
    cli.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt tokens, comma-separated")
    cli.add_argument("--requests", type=int, default=3, help="requests per length (3)")
    cli.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                     help="also run --pd-separate-pools on one host (default on)")
    cli.add_argument("--json", help="also write the figures to this file")
    args = cli.parse_args(argv)
    why = netns_available()
    if why:
        print(f"{PROG}: {why}", file=sys.stderr)
        return 2
    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = vocab_size(args.model)
    common = ["--pool-blocks", str(2 * (max(lengths) // 16 + 8) * (args.requests + 2)),
              "--chunk-size", "512", "--pd", "1:1",
              *(["--model", args.model] if args.model else [])]
    lab = NetnsLab(num_hosts=2, cpus=1.0).up()
    try:
        config = Path(tempfile.mkdtemp(prefix="justapi-xhost-")) / "ray.toml"
        config.write_text(f'launcher = "ray"\naddress = "{lab.address}"\n'
                          f'node-ip = "{lab.head_ip}"\nplacement = "strict_spread"\n')
        before = lab.veth_bytes()
        cross = run([*common, "--config", str(config)], lengths, args.requests, vocab, lab)
        veth = lab.veth_bytes() - before
    finally:
        lab.down()
    local = (run([*common, "--pd-separate-pools"], lengths, args.requests, vocab)
             if args.baseline else None)
    print(f"KV hand-off prefill host -> decode host ({args.requests} request(s) per length; "
          f"{veth / 2**20:.0f} MiB crossed the veths)")
    print(render(lengths, cross, local))
    print(f"decode: {cross['decode']['bytes_per_step']:.0f} bytes on the veths per step of one "
          "stream (plan, result, heartbeats; both hops)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cross_host": cross, "one_host": local}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
