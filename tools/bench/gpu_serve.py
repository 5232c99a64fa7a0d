"""The GPU served figures (issue 38's targets): per model, one `justapi serve --gpu --weights auto`
driven by `justapi bench serve` and by a mixed constrained/free batch:

  single     one stream, 128 output tokens (ignore_eos)
  batch-16   16 streams at once, 128-token prompts and outputs (the offline benchmark's shape)
  batch-64   64 streams
  prefix     shared ~512-token prefix, short questions (the prefix cache)
  burst      decode streams while bursts of long prompts arrive (long-burst): the decodes' ITL
             under mixed steps against batch-16's
  structured half the requests of a batch of 32 constrained by a JSON schema, half free:
             each group's tokens per second per request

A stream's decode rate is 1 / its TPOT p50 (time per output token after the first), so N
streams decode at N / TPOT p50 tok/s, the figure to hold against the offline step
(tools/bench/gpu.py); output tok/s also counts the prompts' time. (ITL is no rate: the
frontend coalesces tokens that arrive together into one delivery.) On a CPU (JUSTAPI_TEST_GPU_DEVICE=cpu) it is a dry run: a tiny model, a few
short requests, no --gpu; its figures mean nothing.

    python -m tools.bench gpu-serve [--models "smollm2;synthetic:..."] [--json serve.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import httpx

from tools.bench.gpu import DEVICE_ENV, DRY_RUN_Q4_K_M, LLAMA_1B_Q4_K_M
from tools.bench.serve import run_bench
from tools.harness import ServedPool

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench gpu-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=os.environ.get(DEVICE_ENV, "cuda"))
    parser.add_argument("--models", default="", help="';'-separated GGUF paths / synthetic: specs / smollm2")
    parser.add_argument("--max-tokens", type=int, default=0, help="output tokens per request (128; dry run 6)")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)
    args.is_dry = args.device == "cpu"
    args.models = args.models or (DRY_RUN_Q4_K_M if args.is_dry else f"smollm2;{LLAMA_1B_Q4_K_M}")
    args.max_tokens = args.max_tokens or (6 if args.is_dry else 128)
    return args


def workloads(args: argparse.Namespace, path: str) -> dict[str, list[str]]:
    """`justapi bench serve` flags per workload (the dry run's few and short); prompts sized
    with the model's own tokenizer."""
    n, many = str(args.max_tokens), (4, 8) if args.is_dry else (16, 64)
    fixed = ["--ignore-eos", "--temperature", "0", "--max-tokens", n]
    sized = {name: [*flags, "--tokenizer-gguf", path] for name, flags in {
        "single": ["--workload", "single", "--num-requests", "2" if args.is_dry else "4",
                   "--prompt-tokens", "128", *fixed],
        f"batch-{many[0]}": ["--workload", "batch", "--concurrency", str(many[0]), "--num-requests",
                             str(many[0]), "--prompt-tokens", "128", *fixed],
        f"batch-{many[1]}": ["--workload", "batch", "--concurrency", str(many[1]), "--num-requests",
                             str(many[1]), "--prompt-tokens", "128", *fixed],
        "prefix": ["--workload", "shared-prefix", "--num-requests", "4" if args.is_dry else "32",
                   "--ignore-eos", "--max-tokens", "8" if args.is_dry else "32"],
        "burst": ["--workload", "long-burst", "--num-requests", "4" if args.is_dry else "24",
                  "--decode-streams", "2" if args.is_dry else "8", "--burst-size", "2" if args.is_dry else "4",
                  "--burst-interval-s", "1.0", "--max-tokens", "8" if args.is_dry else "256",
                  "--prompt-tokens", "64" if args.is_dry else "1024", "--ignore-eos"],
    }.items()}
    return sized


def figures(summary: dict[str, Any], streams: int) -> dict[str, Any]:
    tpot = summary["tpot_ms"]["p50"]
    return {"output_tok_per_s": summary["output_throughput"], "tpot_p50_ms": tpot,
            "decode_tok_per_s": streams * 1e3 / tpot if tpot else None,
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "num_failed": summary["num_failed"]}


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
               structured: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                            "temperature": 0.7, "seed": len(prompt)}
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    start = time.perf_counter()
    reply = await client.post(f"{url}/v1/chat/completions", json=body)
    seconds = time.perf_counter() - start
    reply.raise_for_status()
    tokens = reply.json()["usage"]["completion_tokens"]
    return {"structured": structured, "tokens": tokens, "seconds": seconds}


async def _mixed_batch(url: str, num: int, max_tokens: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*[
            _one(client, url, f"Describe person number {i} as JSON with a name, an age and tags.",
                 max_tokens, structured=i % 2 == 1) for i in range(num)])


def structured_vs_free(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Per group: mean over requests of tokens / seconds (each request's own rate in the batch)."""
    records = asyncio.run(_mixed_batch(url, 4 if args.is_dry else 32, args.max_tokens))
    out: dict[str, Any] = {}
    for name, is_structured in (("free", False), ("structured", True)):
        group = [r for r in records if r["structured"] == is_structured]
        out[f"{name}_tok_per_s_per_request"] = sum(r["tokens"] / r["seconds"] for r in group) / len(group)
        out[f"{name}_tokens"] = sum(r["tokens"] for r in group)
    out["ratio"] = out["structured_tok_per_s_per_request"] / out["free_tok_per_s_per_request"]
    return out


def measure_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from tools.bench.gpu_run import resolve  # imports torch: not before the flags are read

    path, name = resolve(model)
    flags = ["--model", path, "--weights", "auto", "--max-seqs", "64", "--log-level", "warning"]
    if not args.is_dry:
        flags.append("--gpu")
    out: dict[str, Any] = {"name": name, "path": path}
    start = time.perf_counter()
    with ServedPool(*flags, ready_timeout_s=600) as server:
        out["start_s"] = time.perf_counter() - start
        print(f"{name}: served in {out['start_s']:.1f} s", flush=True)
        for workload, bench in workloads(args, path).items():
            report = run_bench(server.base_url, bench)
            streams = int(bench[bench.index("--concurrency") + 1]) if "--concurrency" in bench else 1
            out[workload] = figures(report["summary"], streams)
            if workload == "burst":
                decode = report.get("groups", {}).get("decode")
                out[workload]["decode_tpot_p50_ms"] = decode["tpot_ms"]["p50"] if decode else None
            print(f"  {workload}: {out[workload]}", flush=True)
        out["structured"] = structured_vs_free(server.base_url, args)
        print(f"  structured: {out['structured']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.is_dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    report: dict[str, Any] = {"device": args.device, "max_tokens": args.max_tokens, "models": []}
    for model in args.models.split(";"):
        report["models"].append(measure_model(model, args))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
