"""The weight paths side by side from one run, per weight type: fp32, bf16 (bf16 matmuls), q4
(torch's int4 kernels) and auto (GGUF blocks in memory, the path per step from a plan measured
at start-up); and the KV cache dtypes (a path as PATH/KV, e.g. auto/float16, or
--kv-cache-dtypes to run each path with each).

For the model and, with --types, the same model quantized again as each type (requant.py),
prints per path, with the load average (the machine is shared: decode figures are medians):
  load (s), weights (MiB: the tensors the model keeps), private memory of a process that loads
  the model as a worker does (MiB, in a fresh process, against the file's size), prefill and
  decode tokens/s, perplexity on justapi/ops/data/prose.txt against fp32's, greedy agreement
  with fp32, and for auto the path each matrix takes at each batch size.

    python -m tools.bench quant [--model FILE.gguf] [--types Q4_K,Q6_K] [--paths fp32,auto]
    python -m tools.bench quant --plans [--repeats 5]      # per-matmul timings behind auto's plans
    python -m tools.bench quant --int8                     # the int8-activation step at 1-4 rows
    python -m tools.bench quant --paired fp32,auto --batches 1,16,64   # decode steps in turns
    python -m tools.bench quant --paired fp32,auto --batches 1 --paired-prefill 64,512,2048
    python -m tools.bench quant --paths auto --kv-cache-dtypes float32,bfloat16,float16
    python -m tools.bench quant --paired auto/bfloat16,auto/float16 --batches 1,16,64 --paired-prefix 16@512

The first column (path) is the baseline of the perplexity and greedy rows, the first paired
path that of the ratios. --paired-prefix N@P: N sequences sharing a P-token prompt (its blocks
cached once, as the prefix cache shares them), each with 16 tokens of its own, decoding.
"""
from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.ops.perplexity import DEFAULT_TEXT
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from tools.bench.engine import run_steps
from tools.bench.quant_paths import block_linears, int8_step, path_tables
from tools.bench.requant import requantized
from workers.engine import LLMEngine, resolve_model
from workers.model.forward import DecoderModel
from workers.model.perplexity import perplexity
from workers.weights.block_linear import BlockLinear, StackLinear
from workers.weights.block_matrix import BlockMatrix, RowStack
from workers.weights.paths import load_model
from workers.weights.quant_blocks import QuantMatrix
from workers.weights.quant_linear import Int4Linear

PATHS = ("fp32", "bf16", "q4", "auto")
TEXT = DEFAULT_TEXT
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are", "To make a cup of tea, first",
           "In 1969, the first person to walk on the moon", "The best way to learn a language is",
           "Water boils at"]


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors a linear or a matrix keeps (blocks, 4-bit codes, dense copies)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (BlockLinear, BlockMatrix)):
        return obj.num_bytes
    if isinstance(obj, (StackLinear, RowStack)):
        return sum(tensor_bytes(p) for p in obj.parts)
    if isinstance(obj, (Int4Linear, QuantMatrix)):
        return obj.num_bytes
    return tensor_bytes(obj.weight)  # Linear


def weight_bytes(model: DecoderModel) -> int:
    linears = [model.output] + [lin for layer in model.layers for lin in layer.linears()]
    embd = 0 if model.token_embd is getattr(model.output, "matrix", None) else tensor_bytes(model.token_embd)
    return sum(tensor_bytes(lin) for lin in linears) + embd


def private_mib() -> tuple[float, float]:
    """(RssAnon, RssFile) of this process in MiB."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Rss"))
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))  # type: ignore[return-value]


def memory_probe(model_path: str, path: str) -> dict[str, float]:
    """Load as a worker does (load_model, warm-up of every row bucket, file closed), in this
    fresh process: private memory added by the model, beyond torch and the kernels."""
    from workers.weights.block_kernels import block_kernels

    block_kernels()
    torch.zeros(64, 64) @ torch.zeros(64, 64)
    gc.collect()
    anon0, _ = private_mib()
    model = load_model(GGUFFile(model_path), weights=path, progress=False)
    model.warm_up(2048, 32)
    gc.collect()
    anon1, file1 = private_mib()
    return dict(added_mib=anon1 - anon0, file_backed_mib=file1, weights_mib=weight_bytes(model) / 2**20)


def measure_memory(model_path: str, path: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "tools.bench", "quant", "--memory-probe", path, "--model", model_path],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_engine(model_path: str, name: str, **kwargs: Any) -> LLMEngine:
    """The engine of a column: a weight path, or PATH/KV with a KV cache dtype (else the
    engine's default, the exact fp32 cache on CPU)."""
    path, _, kv = name.partition("/")
    return LLMEngine(model_path, progress=False, weights=path, kv_cache_dtype=kv or None, **kwargs)


def column_names(paths: list[str], kv_dtypes: list[str]) -> list[str]:
    return [f"{path}/{kv}" if kv else path for path in paths for kv in kv_dtypes]


def decode_rates(engine: LLMEngine, batches: list[int], steps: int, prompt_tokens: int) -> dict[int, float]:
    rng = np.random.default_rng(0)
    rates = {}
    for num_seqs in batches:
        prompts = [rng.integers(0, engine.model.params.vocab_size, prompt_tokens).tolist() for _ in range(num_seqs)]
        rates[num_seqs] = num_seqs / statistics.median(run_steps(engine, prompts, steps)[1])
    return rates


def prefill_rate(engine: LLMEngine, num_tokens: int) -> float:
    prompt = np.random.default_rng(1).integers(0, engine.model.params.vocab_size, num_tokens).tolist()
    return num_tokens / statistics.median([run_steps(engine, [prompt], 1)[0] for _ in range(3)])


def auto_choices(model: DecoderModel, batches: list[int]) -> str:
    """For each batch size, how many of the model's block matrices take each path."""
    linears = block_linears(model)
    parts = []
    for rows in batches:
        counts = collections.Counter(lin.plan.path_for(rows) for lin in linears)
        parts.append(f"{rows} rows: " + ", ".join(f"{n} {path}" for path, n in sorted(counts.items())))
    return "; ".join(parts)


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    """(mean fraction of tokens before the first difference, prompts identical throughout)."""
    fractions, same = [], 0
    for ref, out in zip(reference, other):
        prefix = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        fractions.append(prefix / max(len(ref), 1))
        same += ref == out
    return statistics.mean(fractions), same


def bench_file(model_path: str, paths: list[str], args: argparse.Namespace) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    need = max(batches) * -(-(args.prompt_tokens + args.decode_steps + 1) // 16) + 64
    rows: dict[str, dict[str, Any]] = {}
    greedy: dict[str, list[list[int]]] = {}
    for path in paths:
        start = time.perf_counter()
        engine = make_engine(model_path, path, num_blocks=need, max_seqs=max(batches))
        row: dict[str, Any] = dict(load_s=time.perf_counter() - start,
                                   **measure_memory(model_path, path.partition("/")[0]))
        ids = engine.encode(TEXT.read_text())
        row["ppl"] = perplexity(engine, ids, args.n_ctx) if not args.skip_perplexity else None
        outputs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True))
        greedy[path] = [o.token_ids for o in outputs]
        row.update(prefill=prefill_rate(engine, args.prefill_tokens),
                   decode=decode_rates(engine, batches, args.decode_steps, args.prompt_tokens))
        if engine.model is not None and path.startswith("auto"):
            row["choices"] = auto_choices(engine.model, batches)
        rows[path] = row
        engine.close()
        print(f"{path}: done (load average {os.getloadavg()[0]:.2f})", flush=True)
    report(model_path, rows, greedy, batches, args)


def report(model_path: str, rows: dict[str, dict[str, Any]], greedy: dict[str, list[list[int]]],
           batches: list[int], args: argparse.Namespace) -> None:
    paths = list(rows)
    file_mib = os.path.getsize(model_path) / 2**20
    print(f"\n{os.path.basename(model_path)} ({file_mib:.0f} MiB)\n{'':34}" + "".join(f"{p:>12}" for p in paths))
    lines: list[tuple[str, Callable[[dict[str, Any]], float], str]] = [
        ("load (s)", lambda r: r["load_s"], ".1f"),
        ("weights kept (MiB)", lambda r: r["weights_mib"], ".0f"),
        ("private memory added (MiB)", lambda r: r["added_mib"], ".0f"),
        ("  / file size", lambda r: r["added_mib"] / file_mib, ".2f"),
        (f"prefill {args.prefill_tokens} tokens (tok/s)", lambda r: r["prefill"], ".1f")]
    lines += [(f"decode {b} seqs (tok/s)", functools.partial(_decode_rate, b), ".1f") for b in batches]
    for label, value, fmt in lines:
        print(f"{label:34}" + "".join(f"{value(rows[p]):12{fmt}}" for p in paths))
    first = paths[0]
    if not args.skip_perplexity:
        base = rows[first]["ppl"].perplexity
        print(f"{'perplexity':34}" + "".join(f"{rows[p]['ppl'].perplexity:12.4f}" for p in paths))
        print(f"{'  vs ' + first:34}" + "".join(f"{100 * (rows[p]['ppl'].perplexity / base - 1):+11.3f}%" for p in paths))
    for path in paths[1:]:
        mean, same = greedy_agreement(greedy[first], greedy[path])
        print(f"greedy {path} vs {first} ({len(PROMPTS)} prompts x {args.greedy_tokens}): "
              f"{100 * mean:.1f}% of tokens before the first difference, {same} identical")
    for path in paths:
        if "choices" in rows[path]:
            print(f"{path}'s matmul paths per batch size: {rows[path]['choices']}")
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


def _decode_rate(batch: int, row: dict[str, Any]) -> float:
    return row["decode"][batch]


def paired_decode(args: argparse.Namespace, paths: list[str], batches: list[int]) -> None:
    """Decode steps of each path in turns (rounds of 8 steps each), so the host's swings fall on
    every path alike: the median step per path and each path's speed against the first."""
    prefills = [int(n) for n in args.paired_prefill.split(",") if n]
    prefix = [int(n) for n in args.paired_prefix.split("@")] if args.paired_prefix else []
    need = max(batches) * -(-(args.prompt_tokens + 9) // 16) + max([0, *prefills]) // 16 + 64
    if prefix:
        need = max(need, prefix[0] * 3 + -(-prefix[1] // 16) + 64)
    engines = {path: make_engine(args.model, path, num_blocks=need, max_seqs=max([*batches, *prefix[:1]]))
               for path in paths}
    rng = np.random.default_rng(0)
    vocab = engines[paths[0]].model.params.vocab_size
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"paired decode steps, {args.rounds} rounds of 8 per path, prompts of {args.prompt_tokens} tokens"
          f"{'; CPU time' if args.cpu_time else ''}; torch threads {torch.get_num_threads()}")
    for num_seqs in batches:
        prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(num_seqs)]
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path, engine in engines.items():
                times[path] += run_steps(engine, prompts, 8, clock)[1]
        median = {path: statistics.median(t) for path, t in times.items()}
        print(f"decode {num_seqs:3d} seqs: " + ", ".join(
            f"{path} {median[path] * 1e3:.1f} ms ({median[paths[0]] / median[path]:.2f}x)" for path in paths))
    for num_tokens in prefills:  # one prompt's prefill in one step, in turns
        prompt = rng.integers(0, vocab, num_tokens).tolist()
        times = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path, engine in engines.items():
                times[path].append(run_steps(engine, [prompt], 0, clock)[0])
        median = {path: statistics.median(t) for path, t in times.items()}
        print(f"prefill {num_tokens:4d} tokens: " + ", ".join(
            f"{path} {num_tokens / median[path]:.0f} tok/s ({median[paths[0]] / median[path]:.2f}x)" for path in paths))
    if prefix:
        num_seqs, shared = prefix
        prompt = rng.integers(0, vocab, shared).tolist()
        own = [rng.integers(0, vocab, 16).tolist() for _ in range(num_seqs)]
        times = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path, engine in engines.items():
                times[path] += run_prefix_steps(engine, prompt, own, 8, clock)
        median = {path: statistics.median(t) for path, t in times.items()}
        print(f"decode {num_seqs} seqs sharing {shared} tokens: " + ", ".join(
            f"{path} {median[path] * 1e3:.1f} ms ({median[paths[0]] / median[path]:.2f}x)" for path in paths))
    for engine in engines.values():
        engine.close()


def run_prefix_steps(engine: LLMEngine, prompt: list[int], own: list[list[int]], decode_steps: int,
                     clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Sequences whose prompts are `prompt` (whole blocks, written once by the first sequence's
    prefill) + their own tokens: the others' first chunks start past the shared blocks, as
    prefix-cache hits do. Seconds of each decode step."""
    runner, bs = engine.runner, engine.pool.shape.block_size
    if len(prompt) % bs:
        raise SystemExit(f"--paired-prefix: the shared prompt must be whole blocks of {bs} tokens")
    shared = list(range(len(prompt) // bs))
    per_seq = -(-(max(map(len, own)) + decode_steps + 1) // bs)
    ids = [f"prefix-{i}" for i in range(len(own))]
    tables = [shared + [len(shared) + i * per_seq + j for j in range(per_seq)] for i in range(len(own))]
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    new = [NewRequest(r, params, len(prompt) + len(o), np.asarray(prompt + o, np.int32)) for r, o in zip(ids, own)]
    first = runner.execute(StepPlan.build(0, [(ids[0], 0, prompt + own[0], tables[0], True)], new[:1]))
    rest = runner.execute(StepPlan.build(1, [(r, len(prompt), o, t, True) for r, o, t in
                                             zip(ids[1:], own[1:], tables[1:])], new[1:]))
    tokens = [int(first.sampled_token_ids[0]), *map(int, rest.sampled_token_ids)]
    lengths = [len(prompt) + len(o) for o in own]
    times = []
    for step in range(decode_steps):
        chunks = [(r, n + step, [t], tab, True) for r, n, t, tab in zip(ids, lengths, tokens, tables)]
        start = clock()
        tokens = [int(t) for t in runner.execute(StepPlan.build(2 + step, chunks)).sampled_token_ids]
        times.append(clock() - start)
    runner.execute(StepPlan.build(10**6, [], finished_request_ids=ids))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench quant", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="GGUF path (default SmolLM2-135M-Instruct)")
    parser.add_argument("--types", default="", help="also the model quantized as each of these types")
    parser.add_argument("--paths", default=",".join(PATHS), help="weight paths, each PATH or PATH/KV")
    parser.add_argument("--kv-cache-dtypes", default="", help="each path with each of these KV dtypes")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--n-ctx", type=int, default=512, help="perplexity window")
    parser.add_argument("--greedy-tokens", type=int, default=48)
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--plans", action="store_true", help="only the per-matmul path timings")
    parser.add_argument("--int8", action="store_true",
                        help="only one step's matmuls on each kernel (at --batches rows)")
    parser.add_argument("--repeats", type=int, default=5, help="--plans / --int8: timed rounds")
    parser.add_argument("--int8-kernels", default="", help="--int8: only these columns (comma-separated; "
                        "leaving out the torch ones keeps their spinning threads off the block kernels' turns)")
    parser.add_argument("--paired", default="", help="only time decode steps of these paths in turns")
    parser.add_argument("--rounds", type=int, default=5, help="--paired: rounds per batch size")
    parser.add_argument("--cpu-time", action="store_true", help="--paired: time this process's CPU time, not "
                        "the wall (with --threads 1: the work, whatever else runs on the host)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--paired-prefill", default="",
                        help="--paired: also prefill prompts of these token counts in turns (one step each)")
    parser.add_argument("--paired-prefix", default="", help="--paired: also N@P, N sequences sharing a P-token "
                        "prompt, decoding in turns")
    parser.add_argument("--memory-probe", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    files = [model] + [requantized(model, t) for t in filter(None, args.types.split(","))]
    if args.memory_probe:
        print(json.dumps(memory_probe(model, args.memory_probe)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}", flush=True)
    for path in files:
        args.model = path
        if args.paired:
            paired_decode(args, args.paired.split(","), [int(b) for b in args.batches.split(",")])
        elif args.plans:
            path_tables(path, args.repeats)
        elif args.int8:
            int8_step(path, args.repeats, tuple(int(b) for b in args.batches.split(",")),
                      tuple(filter(None, args.int8_kernels.split(","))))
        else:
            bench_file(path, column_names(args.paths.split(","), args.kv_cache_dtypes.split(",")), args)


if __name__ == "__main__":
    main()
