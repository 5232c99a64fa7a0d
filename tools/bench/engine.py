"""Benchmark the model runtime on this machine and print figures beside the hardware's own.

For each phase (prefill, decode at 1 / 16 / 64 sequences) it prints the runtime's tokens/s and,
measured in the same run, the tokens/s the model's matmuls alone reach at the same M (rows
per step) with the same weights and kernels — the ratio shows how far the whole step
(attention, norms, rotary, sampling, Python) is from the matmul bound. The machine is shared
with other work, so each figure is the best window of 8 consecutive steps (best of 3 runs for
prefill), with the median step beside it.

    python -m tools.bench engine [--model FILE.gguf] [--decode-steps 32] [--prompt-tokens 128] [--weights auto]

`--weights` is the in-process engine's (default fp32, the dense copy; `justapi serve` and
`step-parts` default to auto, the GGUF blocks), and the header line names it.

With --attention-paired (CPU) the decode phases instead run with the native paged-attention
kernel and with the gathered torch path, in turns (alternating which goes first), and print
the ratio of the two.

With --wait-policies (CPU) each decode batch runs in a fresh process per OpenMP wait setting
(sleep at once, spin 1,000 / 10,000 / 100,000 rounds, spin without end), in turns, and prints
the median decode step of each: what `justapi serve --cpu-spin` trades (docs/runtime.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import torch

from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from workers.engine import LLMEngine
from workers.model.attention import TorchCpuBackend


def matmul_step_s(engine: LLMEngine, num_rows: int, repeats: int = 7) -> list[float]:
    """Seconds per step if a step were only the model's matmuls at M = num_rows (the head
    on one row per sequence: all rows when decoding, the last one of a prefill)."""
    model, p = engine.model, engine.model.params
    x = torch.randn(num_rows, p.hidden_size)
    inputs = {linear.in_features: torch.randn(num_rows, linear.in_features)
              for linear in model.layers[0].linears()}  # [M, in] per input width
    head_rows = x[-1:] if num_rows > 64 else x
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in model.layers:
                for linear in layer.linears():
                    linear(inputs[linear.in_features])
            model.output(head_rows)
            times.append(time.perf_counter() - start)
    return times


def run_steps(engine: LLMEngine, prompts: list[list[int]], decode_steps: int,
              clock: Callable[[], float] = time.perf_counter) -> tuple[float, list[float]]:
    """Prefill all prompts in one step, then decode_steps steps of one token per sequence.
    Returns (prefill seconds, seconds of each decode step), by `clock` (wall time, or e.g.
    time.process_time: CPU time)."""
    runner, bs = engine.runner, engine.pool.shape.block_size
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    ids = [f"bench-{i}" for i in range(len(prompts))]
    per_seq = -(-(max(map(len, prompts)) + decode_steps + 1) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    new = [NewRequest(r, params, len(p), np.asarray(p, np.int32)) for r, p in zip(ids, prompts)]
    start = clock()
    tokens = runner.execute(StepPlan.build(0, [(r, 0, p, t, True) for r, p, t in zip(ids, prompts, tables)],
                                           new)).sampled_token_ids
    prefill_s = clock() - start
    lengths = [len(p) for p in prompts]
    times = []
    for step in range(decode_steps):
        chunks = [(r, n + step, [int(t)], tab, True) for r, n, t, tab in zip(ids, lengths, tokens, tables)]
        start = clock()
        tokens = runner.execute(StepPlan.build(1 + step, chunks)).sampled_token_ids
        times.append(clock() - start)
    runner.execute(StepPlan.build(10**6, [], finished_request_ids=ids))
    return prefill_s, times


def matmul_flops(engine: LLMEngine, rows: int) -> int:
    """FLOPs of one step's matmuls at M = rows (the head on the rows matmul_step_s uses)."""
    p = engine.model.params
    per_row = p.num_layers * p.hidden_size * (p.q_size + 2 * p.kv_size + p.hidden_size + 3 * p.ffn_size)
    return 2 * (rows * per_row + min(rows, 64 if rows <= 64 else 1) * p.vocab_size * p.hidden_size)


WINDOW = 8
"""Steps per window: the best window shows the runtime when no other process got in the way."""


def line(label: str, rows: int, step_s: list[float], bound_s: list[float], flops: int) -> str:
    """tok/s over the best window of consecutive steps (and the median step), beside the
    matmul-only rate (best repeat) and its GFLOP/s; the ratio compares the two bests."""
    best, median = rows / best_window_s(step_s), rows / statistics.median(step_s)
    bound = rows / min(bound_s)
    return (f"{label:<34} {best:7.1f} tok/s (median step {median:7.1f}) | matmuls alone "
            f"{bound:7.1f} tok/s ({flops / min(bound_s) / 1e9:5.1f} GFLOP/s) | ratio {best / bound:.2f}")


def best_window_s(step_s: list[float]) -> float:
    windows = [sum(step_s[i:i + WINDOW]) / WINDOW for i in range(len(step_s) - WINDOW + 1)]
    return min(windows or step_s)


def paired_attention(engine: LLMEngine, prompts: list[list[int]], decode_steps: int,
                     rounds: int) -> dict[str, list[float]]:
    """Decode step times with each CPU attention path, the paths taking turns."""
    block_size = engine.pool.shape.block_size
    backends = {"kernel": TorchCpuBackend(block_size),
                "gathered": TorchCpuBackend(block_size, use_kernel=False)}
    if backends["kernel"].kernel is None:
        raise SystemExit("the CPU attention kernel did not build here (see the warning above)")
    times: dict[str, list[float]] = {name: [] for name in backends}
    for turn in range(rounds):
        for name in (list(backends) if turn % 2 == 0 else list(reversed(backends))):
            engine.runner.backend = backends[name]
            times[name] += run_steps(engine, prompts, decode_steps)[1]
    return times


WAIT_SETTINGS = (("sleep at once (PASSIVE)", {"OMP_WAIT_POLICY": "PASSIVE"}),
                 ("spin 1,000", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}),
                 ("spin 10,000", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}),
                 ("spin 100,000", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "100000"}),
                 ("spin without end (ACTIVE)", {"OMP_WAIT_POLICY": "ACTIVE"}))
"""libgomp reads these once, when torch loads it: each setting needs a process of its own."""


def wait_policies(args: argparse.Namespace) -> None:
    """Median decode step (ms) per OpenMP wait setting and batch, fresh processes in turns."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for batch in args.batches.split(","):
        medians: dict[str, list[float]] = {name: [] for name, _ in WAIT_SETTINGS}
        for turn in range(args.rounds):
            for name, env in WAIT_SETTINGS if turn % 2 == 0 else WAIT_SETTINGS[::-1]:
                done = subprocess.run(
                    [sys.executable, "-m", "tools.bench", "engine", "--model", args.model, "--batches", batch,
                     "--decode-steps", str(args.decode_steps), "--prompt-tokens",
                     str(args.prompt_tokens), "--weights", args.weights, "--median-step-ms"],
                    env={**clean, **env}, capture_output=True, text=True, check=True)
                medians[name].append(float(done.stdout.split()[-1]))
        print(f"decode {batch} seqs, median step ms over {args.rounds} turns:")
        for name, runs in medians.items():
            print(f"  {name:<28} {' / '.join(f'{ms:6.1f}' for ms in runs)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench engine",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="GGUF path or synthetic:SPEC (default SmolLM2)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of decode runs")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--weights", default="fp32", help="fp32 (the in-process engine's default), bf16, q4 "
                        "or auto (justapi serve's default)")
    parser.add_argument("--attention-paired", action="store_true",
                        help="decode with the CPU attention kernel and the gathered path in turns")
    parser.add_argument("--rounds", type=int, default=4,
                        help="turns per path with --attention-paired / --wait-policies")
    parser.add_argument("--wait-policies", action="store_true",
                        help="decode under each OpenMP wait setting, fresh processes in turns")
    parser.add_argument("--median-step-ms", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.wait_policies:
        wait_policies(args)
        return
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    need = max(batches) * -(-(args.prompt_tokens + args.decode_steps + 1) // 16) + 64
    start = time.perf_counter()
    engine = LLMEngine(args.model, num_blocks=need, max_seqs=max(batches), progress=False, weights=args.weights)
    load_s = time.perf_counter() - start
    p = engine.model.params
    print(f"model {engine.model.name}, weights {args.weights}: load {load_s:.2f} s (GGUF parse, dequantize, kernel "
          f"layout, tokenizer); torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    if args.median_step_ms:  # one --wait-policies run: warm up, then the median decode step
        prompts = [rng.integers(0, p.vocab_size, args.prompt_tokens).tolist()
                   for _ in range(batches[0])]
        run_steps(engine, prompts, 4)
        print(f"{statistics.median(run_steps(engine, prompts, args.decode_steps)[1]) * 1e3:.2f}")
        engine.close()
        return
    if args.attention_paired:
        for num_seqs in batches:
            prompts = [rng.integers(0, p.vocab_size, args.prompt_tokens).tolist() for _ in range(num_seqs)]
            best = {name: num_seqs / best_window_s(steps)
                    for name, steps in paired_attention(engine, prompts, args.decode_steps, args.rounds).items()}
            print(f"decode {num_seqs} seqs (context {args.prompt_tokens}-{args.prompt_tokens + args.decode_steps}): "
                  f"kernel {best['kernel']:7.1f} tok/s, gathered {best['gathered']:7.1f} tok/s, "
                  f"ratio {best['kernel'] / best['gathered']:.2f}")
        engine.close()
        return
    prefill = [run_steps(engine, [rng.integers(0, p.vocab_size, args.prefill_tokens).tolist()], 1)[0]
               for _ in range(3)]
    print(line(f"prefill ({args.prefill_tokens}-token prompt)", args.prefill_tokens, prefill,
               matmul_step_s(engine, args.prefill_tokens, repeats=3), matmul_flops(engine, args.prefill_tokens)))
    for num_seqs in batches:
        prompts = [rng.integers(0, p.vocab_size, args.prompt_tokens).tolist() for _ in range(num_seqs)]
        _, steps = run_steps(engine, prompts, args.decode_steps)
        label = f"decode {num_seqs} seqs (context {args.prompt_tokens}-{args.prompt_tokens + args.decode_steps})"
        print(line(label, num_seqs, steps, matmul_step_s(engine, num_seqs), matmul_flops(engine, num_seqs)))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
