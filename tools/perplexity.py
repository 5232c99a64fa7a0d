#!/usr/bin/env python
"""Perplexity of a GGUF model on a text file, for each weight path (--weights fp32|bf16|q4|auto).

Sliding windows as llama.cpp's perplexity tool: n_ctx tokens every `stride` tokens (default
n_ctx / 2), each window a fresh sequence, only its second half scored (workers/model/perplexity.py).
`--chunk-rows N` computes each window N tokens at a time through the KV cache: with a small N,
`auto` takes its int4 path as decode steps do; by default a window is one step (auto: fp32).

    python tools/perplexity.py [--model FILE.gguf] [--text tools/data/prose.txt]
                               [--n-ctx 512] [--stride 256] [--chunk-rows N] [--paths fp32,bf16,q4,auto]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from workers.engine import LLMEngine
from workers.model.perplexity import perplexity

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "prose.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="GGUF path (default SmolLM2-135M-Instruct)")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file")
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--stride", type=int, default=0, help="0: n_ctx / 2")
    parser.add_argument("--chunk-rows", type=int, default=0, help="tokens per step; 0: a window")
    parser.add_argument("--paths", default="fp32,q4,auto")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    print(f"text {args.text}; n_ctx {args.n_ctx}, stride {args.stride or args.n_ctx // 2}, "
          f"chunk rows {args.chunk_rows or args.n_ctx}; load average {os.getloadavg()[0]:.2f}")
    baseline = None
    for path in args.paths.split(","):
        engine = LLMEngine(args.model, device=args.device, weights=path, progress=False,
                           num_blocks=-(-args.n_ctx // 16) + 1, max_seqs=1)
        ids = engine.encode(text)
        start = time.perf_counter()
        result = perplexity(engine, ids, args.n_ctx, args.stride or None, args.chunk_rows or None)
        elapsed = time.perf_counter() - start
        baseline = baseline or result.perplexity
        print(f"{path:>5}: perplexity {result.perplexity:9.4f} ({100 * (result.perplexity / baseline - 1):+.2f}% "
              f"vs {args.paths.split(',')[0]}), {result.num_scored} tokens scored in "
              f"{result.num_windows} windows of {len(ids)}, {elapsed:.1f} s")
        engine.close()


if __name__ == "__main__":
    main()
