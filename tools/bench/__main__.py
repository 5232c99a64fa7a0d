"""`python -m tools.bench <scenario> [flags]`: run one benchmark scenario (its module's main).

A scenario's module is imported only when it runs (engine, quant and spec load torch).
A `justapi serve` that does not come up is one line and exit status 1.
Owns: the scenario names and the dispatch. Does not own: any figure.
"""
from __future__ import annotations

import importlib
import sys

from tools.harness import ServeError

SCENARIOS = {
    "engine": "model runtime steps vs the matmul bound (in-process, torch)",
    "gpu": "GPU decode steps: CUDA graphs / eager / gathered, copy bandwidth share (needs a GPU)",
    "gpu-serve": "justapi serve --gpu: single, 16/64 streams, prefix, burst, structured vs free",
    "gpu-targets": "the GPU targets of docs/bench.md from the gpu and gpu-serve JSON files",
    "serve": "configurations of `justapi serve` side by side (continuous/static, cache, overhead)",
    "pd": "PD disaggregation vs colocated workers on the long-burst workload",
    "peer": "the same streaming workloads against justapi serve and llama-server (or a URL)",
    "llama1b": "the ~1B llama shape (Q4_K_M by llama-quantize) against llama-server, and its memory",
    "spec": "speculative decoding: n-gram, trees, draft models, batch sweep (in-process)",
    "quant": "weight paths fp32 / bf16 / q4 / auto and KV dtypes: speed, memory, perplexity (in-process)",
    "hf-agreement": "greedy tokens vs transformers on llama.cpp-converted tiny models, per KV dtype",
    "scheduler": "scheduler core step and prefix-cache match times (no model)",
    "frontend": "frontend streaming throughput against a stand-in scheduler",
    "failover": "worker SIGKILL / SIGSTOP: detection, rejoin, completed requests",
    "restart": "scheduler SIGKILL under load: pause until the next token, requests lost",
    "cross-host": "KV hand-off between network namespaces (--launcher ray; needs root)",
    "soak": "many requests with disconnects and aborts; nothing may leak",
    "tokenizer": "tokenizer, detokenizer and chat template speed",
    "step-parts": "where an in-process decode step's time goes, part by part (matmuls, attention, ...)",
    "attention": "the CPU decode attention kernel over fp32, bf16 and f16 KV pools, in turns",
    "gemv": "one-row matmuls from GGUF blocks: our int8 kernel against llama.cpp's ggml, in turns",
    "isa-peak": "this CPU's rate of vpmaddubsw, vpdpbusd (256/512-bit) and FMAs: the int8 kernels' ceilings",
    "timeline": "where a served step's time goes (per-process timelines); serving vs offline",
    "structured": "structured outputs: constrained vs free decoding, grammar compile times",
    "plan-check": "what checking each plan against the pool and model costs a decode step",
    "api-2026": "embeddings vs llama-server, TTFT with priorities, the cost of KV events",
    "structured-corpus": "real-world schemas and BFCL tool cases: accepted / valid / correct, "
                         "constrained vs free tok/s (vs llama-server where built)",
}
USAGE = "usage: python -m tools.bench SCENARIO [flags]   (python -m tools.bench SCENARIO --help)"


def module_name(scenario: str) -> str:
    return f"tools.bench.{scenario.replace('-', '_')}"


def usage() -> str:
    return "\n".join([USAGE, "", "scenarios:"] + [f"  {name:<11} {what}"
                                                 for name, what in SCENARIOS.items()])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] not in SCENARIOS:
        print(f"python -m tools.bench: unknown scenario {args[0]!r}\n{usage()}", file=sys.stderr)
        return 2
    scenario = importlib.import_module(module_name(args[0]))
    try:
        return scenario.main(args[1:]) or 0
    except ServeError as exc:
        print(f"python -m tools.bench {args[0]}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
