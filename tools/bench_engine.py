"""Benchmark the model runtime on this machine and print figures beside the hardware's own.

For each phase (prefill, decode at 1 / 16 / 64 sequences) it prints the engine's tokens/s and,
measured in the same run, the tokens/s the model's matmuls alone reach at the same M (rows
per step) with the same weights and the same `linear` — the ratio shows how far the whole
step (attention, norms, rotary, sampling, Python) is from the matmul bound.

    python tools/bench_engine.py [--model FILE.gguf] [--decode-steps 64] [--prompt-tokens 128]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from justapi.protocol import NewRequest, StepPlan
from justapi.sampling import SamplingParams
from workers.engine import LLMEngine


def matmul_tokens_per_s(engine: LLMEngine, num_rows: int, with_head: bool, repeats: int = 3) -> float:
    """Tokens/s if a step were only the model's matmuls at M = num_rows (best of `repeats`)."""
    model, p = engine.model, engine.model.params
    x = torch.randn(num_rows, p.hidden_size)
    x_ffn = torch.randn(num_rows, p.ffn_size)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in model.layers:
                layer.qkv(x), layer.attn_out(x), layer.gate_up(x), layer.down(x_ffn)
            if with_head:
                model.output(x[-1:] if num_rows > 64 else x)
            best = min(best, time.perf_counter() - start)
    return num_rows / best


def run_steps(engine: LLMEngine, prompts: list[list[int]], decode_steps: int) -> tuple[float, float]:
    """Prefill all prompts in one step, then decode_steps steps of one token each.
    Returns (prefill tokens/s, decode tokens/s)."""
    runner, bs = engine.runner, engine.pool.shape.block_size
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    ids = [f"bench-{i}" for i in range(len(prompts))]
    per_seq = -(-(max(map(len, prompts)) + decode_steps + 1) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    new = [NewRequest(r, params, len(p), np.asarray(p, np.int32)) for r, p in zip(ids, prompts)]
    plan = StepPlan.build(0, [(r, 0, p, t, True) for r, p, t in zip(ids, prompts, tables)], new)
    start = time.perf_counter()
    tokens = runner.execute(plan).sampled_token_ids
    prefill_s = time.perf_counter() - start
    lengths = [len(p) for p in prompts]
    start = time.perf_counter()
    for step in range(decode_steps):
        chunks = [(r, n + step, [int(t)], tab, True) for r, n, t, tab in zip(ids, lengths, tokens, tables)]
        tokens = runner.execute(StepPlan.build(1 + step, chunks)).sampled_token_ids
    decode_s = time.perf_counter() - start
    runner.execute(StepPlan.build(10**6, [], finished_request_ids=ids))
    return sum(lengths) / prefill_s, len(prompts) * decode_steps / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="GGUF path or synthetic:SPEC (default SmolLM2)")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of decode runs")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    need = max(batches) * -(-(args.prompt_tokens + args.decode_steps + 1) // 16) + 64
    engine = LLMEngine(args.model, num_blocks=need, max_seqs=max(batches), progress=False)
    print(f"model {engine.model.name}: load {time.perf_counter() - start:.2f} s "
          f"(GGUF parse + dequantize + tokenizer), torch threads {torch.get_num_threads()}")
    rng = np.random.default_rng(0)
    vocab = engine.model.params.vocab_size
    prefill, _ = run_steps(engine, [rng.integers(0, vocab, args.prefill_tokens).tolist()], 1)
    bound = matmul_tokens_per_s(engine, args.prefill_tokens, with_head=True)
    print(f"prefill {args.prefill_tokens} tokens: {prefill:8.1f} tok/s | matmuls alone {bound:8.1f} tok/s "
          f"| ratio {prefill / bound:.2f}")
    for num_seqs in batches:
        prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(num_seqs)]
        _, decode = run_steps(engine, prompts, args.decode_steps)
        bound = matmul_tokens_per_s(engine, num_seqs, with_head=True)
        print(f"decode {num_seqs:3d} seqs (context {args.prompt_tokens}-{args.prompt_tokens + args.decode_steps}): "
              f"{decode:8.1f} tok/s | matmuls alone {bound:8.1f} tok/s | ratio {decode / bound:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
