"""The weight paths side by side from one run: fp32, bf16 (bf16 matmuls), q4 (4-bit weights, int4
kernels) and auto.

Prints, with the load average (the machine is shared: figures are medians of several steps):
  crossover   every layer's matmuls and the head at M rows on the dense kernel and the int4
              kernel, and the crossover (most rows for which int4 won at every M up to there)
              that `--weights auto` uses (workers/weights/paths.py records it);
  decode      tokens/s at 1 / 8 / 32 / 64 sequences and prefill tokens/s, per path;
  accuracy    perplexity of each path on justapi/ops/data/prose.txt (sliding windows, as
              `justapi perplexity`), and greedy agreement of each path with fp32;
  memory      bytes the weights take per path.

    python -m tools.bench quant [--model FILE.gguf] [--batches 1,8,32,64] [--skip-crossover]
    python -m tools.bench quant --crossover-only [--repeats 15]
    python -m tools.bench quant --paired fp32,bf16 --batches 1,16,64   # steps in turns
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.ops.perplexity import DEFAULT_TEXT
from justapi.sampling import SamplingParams
from tools.bench.engine import run_steps
from workers.engine import LLMEngine, resolve_model
from workers.model.forward import DecoderModel
from workers.model.perplexity import perplexity
from workers.weights.paths import CPU_CROSSOVER, Crossover, load_model
from workers.weights.quant_blocks import QuantMatrix
from workers.weights.quant_linear import DualLinear, Int4Linear

PATHS = ("fp32", "bf16", "q4", "auto")
TEXT = DEFAULT_TEXT
CROSSOVER_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are", "To make a cup of tea, first",
           "In 1969, the first person to walk on the moon", "The best way to learn a language is",
           "Water boils at"]


def paired_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each function, timed in turns (one call of each per round, after an
    untimed round: oneDNN builds a new shape's primitive on its first call), so that load from
    other processes falls on all of them alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return [statistics.median(bucket) for bucket in times]


def crossover_table(model_path: str, repeats: int) -> tuple[int, int]:
    """Time the layers' matmuls and the head on both kernels at each M; print; return the
    crossovers (q4 rows, q8 rows)."""
    both = Crossover(q4_rows=1, q8_rows=1)  # any rows > 0: every quantized matrix keeps both copies
    model = load_model(GGUFFile(resolve_model(model_path)), weights="auto", progress=False, crossover=both)
    p = model.params
    duals = [linear for layer in model.layers for linear in layer.linears()
             if isinstance(linear, DualLinear)]
    head = model.output
    assert len(duals) == 4 * len(model.layers) and isinstance(head, DualLinear)
    print(f"matmul time at M rows, median of {repeats} (all {p.num_layers} layers' 4 matmuls | "
          f"the {p.vocab_size}x{p.hidden_size} head):")
    print(f"{'rows':>5} | {'layers fp32':>11} {'layers int4':>11} {'int4/fp32':>9} | "
          f"{'head fp32':>9} {'head int4':>9} {'int4/fp32':>9}")
    wins: dict[str, list[tuple[int, bool]]] = {"layers": [], "head": []}
    with torch.inference_mode():
        for rows in CROSSOVER_ROWS:
            inputs = [torch.randn(rows, d.in_features) for d in duals]
            x_head = torch.randn(rows, p.hidden_size)
            dense_s, quant_s, head_dense_s, head_quant_s = paired_medians([
                lambda: [d.dense(x) for d, x in zip(duals, inputs)],
                lambda: [d.quant(x) for d, x in zip(duals, inputs)],
                lambda: head.dense(x_head), lambda: head.quant(x_head)], repeats)
            wins["layers"].append((rows, quant_s < dense_s))
            wins["head"].append((rows, head_quant_s < head_dense_s))
            print(f"{rows:>5} | {dense_s * 1e3:9.2f}ms {quant_s * 1e3:9.2f}ms {quant_s / dense_s:9.2f} | "
                  f"{head_dense_s * 1e3:7.2f}ms {head_quant_s * 1e3:7.2f}ms {head_quant_s / head_dense_s:9.2f}")
    return _crossover(wins["layers"]), _crossover(wins["head"])


def _crossover(wins: list[tuple[int, bool]]) -> int:
    """Most rows for which int4 won at every measured M up to there (0: never)."""
    best = 0
    for rows, won in wins:
        if not won:
            break
        best = rows
    return best


def decode_rates(engine: LLMEngine, batches: list[int], steps: int, prompt_tokens: int) -> dict[int, float]:
    rng = np.random.default_rng(0)
    vocab = engine.model.params.vocab_size
    rates = {}
    for num_seqs in batches:
        prompts = [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(num_seqs)]
        _, times = run_steps(engine, prompts, steps)
        rates[num_seqs] = num_seqs / statistics.median(times)
    return rates


def paired_decode(args: argparse.Namespace, paths: list[str], batches: list[int]) -> None:
    """Decode steps of each path in turns (rounds of 8 steps each), so the host's swings fall on
    every path alike: the median step per path and each path's speed against the first."""
    need = max(batches) * -(-(args.prompt_tokens + 9) // 16) + 64
    engines = {path: LLMEngine(args.model, num_blocks=need, max_seqs=max(batches), progress=False,
                               weights=path) for path in paths}
    rng = np.random.default_rng(0)
    vocab = engines[paths[0]].model.params.vocab_size
    print(f"paired decode steps, {args.rounds} rounds of 8 per path, prompts of {args.prompt_tokens} tokens")
    for num_seqs in batches:
        prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(num_seqs)]
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path, engine in engines.items():
                times[path] += run_steps(engine, prompts, 8)[1]
        median = {path: statistics.median(t) for path, t in times.items()}
        print(f"decode {num_seqs:3d} seqs: " + ", ".join(
            f"{path} {median[path] * 1e3:.1f} ms ({median[paths[0]] / median[path]:.2f}x)" for path in paths))
    for engine in engines.values():
        engine.close()


def prefill_rate(engine: LLMEngine, num_tokens: int) -> float:
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, engine.model.params.vocab_size, num_tokens).tolist()
    return num_tokens / statistics.median([run_steps(engine, [prompt], 1)[0] for _ in range(3)])


def weight_bytes(model: DecoderModel) -> int:
    """Bytes of every matrix the model keeps (both copies under auto) and the embedding."""
    def linear_bytes(linear: object) -> int:
        if isinstance(linear, DualLinear):
            return linear_bytes(linear.dense) + linear_bytes(linear.quant)
        if isinstance(linear, Int4Linear):
            return linear.num_bytes
        weight = linear.weight  # type: ignore[attr-defined]
        return weight.numel() * weight.element_size()

    linears = [model.output] + [lin for layer in model.layers for lin in layer.linears()]
    embd = model.token_embd
    embd_bytes = embd.num_bytes if isinstance(embd, QuantMatrix) else embd.numel() * embd.element_size()
    return sum(linear_bytes(lin) for lin in linears) + embd_bytes


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    """(mean fraction of tokens before the first difference, prompts identical throughout)."""
    fractions, same = [], 0
    for ref, out in zip(reference, other):
        prefix = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        fractions.append(prefix / max(len(ref), 1))
        same += ref == out
    return statistics.mean(fractions), same


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench quant",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="GGUF path (default SmolLM2-135M-Instruct)")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per crossover point")
    parser.add_argument("--n-ctx", type=int, default=512, help="perplexity window")
    parser.add_argument("--greedy-tokens", type=int, default=48)
    parser.add_argument("--skip-crossover", action="store_true")
    parser.add_argument("--crossover-only", action="store_true")
    parser.add_argument("--paired", default="",
                        help="only time decode steps of these paths in turns, e.g. fp32,bf16")
    parser.add_argument("--rounds", type=int, default=5, help="--paired: rounds per batch size")
    args = parser.parse_args(argv)
    if args.paired:
        paired_decode(args, args.paired.split(","), [int(b) for b in args.batches.split(",")])
        return
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}")
    if not args.skip_crossover:
        q4_rows, q8_rows = crossover_table(args.model, args.repeats)
        print(f"crossover: int4 won up to {q4_rows} rows for Q4 matrices, {q8_rows} rows for Q8_0 "
              f"-> Crossover(q4_rows={q4_rows}, q8_rows={q8_rows}); recorded: {CPU_CROSSOVER}; "
              f"load average {os.getloadavg()[0]:.2f}\n")
    if args.crossover_only:
        return
    text = TEXT.read_text()
    need = max(batches) * -(-(args.prompt_tokens + args.decode_steps + 1) // 16) + 64
    rows: dict[str, dict[str, Any]] = {}
    greedy: dict[str, list[list[int]]] = {}
    for path in PATHS:
        start = time.perf_counter()
        engine = LLMEngine(args.model, num_blocks=need, max_seqs=max(batches), progress=False,
                           weights=path)
        load_s = time.perf_counter() - start
        ids = engine.encode(text)
        ppl = perplexity(engine, ids, args.n_ctx)
        ppl_small = perplexity(engine, ids, args.n_ctx, chunk_rows=16) if path == "auto" else None
        outputs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.greedy_tokens,
                                                          ignore_eos=True))
        greedy[path] = [o.token_ids for o in outputs]
        rows[path] = dict(load_s=load_s, bytes=weight_bytes(engine.model), ppl=ppl, ppl_small=ppl_small,
                          prefill=prefill_rate(engine, args.prefill_tokens),
                          decode=decode_rates(engine, batches, args.decode_steps, args.prompt_tokens))
        engine.close()
        print(f"{path}: done (load average {os.getloadavg()[0]:.2f})")
    report(rows, greedy, batches, len(ids), args)


def report(rows: dict[str, dict[str, Any]], greedy: dict[str, list[list[int]]],
           batches: list[int], num_tokens: int, args: argparse.Namespace) -> None:
    print(f"\n{'':34}" + "".join(f"{path:>12}" for path in PATHS))
    print(f"{'load (s)':34}" + "".join(f"{rows[p]['load_s']:12.1f}" for p in PATHS))
    print(f"{'weights (MiB)':34}" + "".join(f"{rows[p]['bytes'] / 2**20:12.0f}" for p in PATHS))
    print(f"{f'prefill {args.prefill_tokens} tokens (tok/s)':34}"
          + "".join(f"{rows[p]['prefill']:12.1f}" for p in PATHS))
    for b in batches:
        print(f"{f'decode {b} seqs (tok/s)':34}" + "".join(f"{rows[p]['decode'][b]:12.1f}" for p in PATHS))
    base = rows["fp32"]["ppl"].perplexity
    print(f"{'perplexity (windows in one step)':34}" + "".join(
        f"{rows[p]['ppl'].perplexity:12.3f}" for p in PATHS))
    print(f"{'  vs fp32':34}" + "".join(
        f"{100 * (rows[p]['ppl'].perplexity / base - 1):+11.2f}%" for p in PATHS))
    small = rows["auto"]["ppl_small"]
    scored = rows["fp32"]["ppl"]
    print(f"perplexity of auto in 16-token chunks (its int4 path): {small.perplexity:.3f} "
          f"({100 * (small.perplexity / base - 1):+.2f}%); text {TEXT.name}: {num_tokens} tokens, "
          f"n_ctx {args.n_ctx}, stride {args.n_ctx // 2}, {scored.num_scored} scored in "
          f"{scored.num_windows} windows")
    for path in PATHS[1:]:
        mean, same = greedy_agreement(greedy["fp32"], greedy[path])
        print(f"greedy agreement {path} vs fp32 ({len(PROMPTS)} prompts x {args.greedy_tokens} tokens): "
              f"{100 * mean:.1f}% of tokens before the first difference, {same} identical")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
