"""Perplexity of a model on a token sequence, scored as llama.cpp's perplexity tool does.

Windows of `n_ctx` tokens start every `stride` tokens (a tail shorter than a window is left out);
each window is a fresh sequence from position 0 and only its second half is scored, so every
scored token sees at least n_ctx / 2 tokens of context. With stride = n_ctx / 2 (the default)
each token after the first window's first half is scored exactly once.

    tokens:  |------ window 0 ------|
                        |------ window 1 ------|        x = scored (second halves)
             |  ctx    x x x x x x x x x x x x x x x x x x

A window is computed in chunks of `chunk_rows` tokens through the paged KV cache (chunked
prefill); small chunks make `--weights auto` take its 4-bit path, as decode steps do.
Owns: windowing and scoring. Does not own: the model or its weights (engine.py, weight_paths.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from workers.engine import LLMEngine
from workers.model.attention import AttentionBatch


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    """Mean negative log-likelihood (nats) of the scored tokens."""
    num_scored: int
    num_windows: int


def window_starts(num_tokens: int, n_ctx: int, stride: int) -> list[int]:
    """First token of each window: 0, stride, 2 * stride, ... while a whole window fits."""
    if n_ctx < 2 or stride < 1:
        raise ValueError(f"perplexity needs n_ctx >= 2 and stride >= 1, got n_ctx={n_ctx}, "
                         f"stride={stride}")
    if num_tokens < n_ctx:
        raise ValueError(f"the text has {num_tokens} tokens, fewer than one window (n_ctx={n_ctx})")
    return list(range(0, num_tokens - n_ctx + 1, stride))


def position_logits(engine: LLMEngine, token_ids: Sequence[int], first: int, last: int,
                    chunk_rows: int) -> torch.Tensor:
    """fp32 logits [last - first, vocab] at positions [first, last) of one sequence computed from
    position 0 in chunks of `chunk_rows` tokens (the engine's KV blocks from 0 are overwritten)."""
    model, backend, pool = engine.model, engine.runner.backend, engine.pool
    n = len(token_ids)
    block_ids = np.arange(-(-n // pool.shape.block_size), dtype=np.int64)
    if len(block_ids) > pool.shape.num_blocks:
        raise ValueError(f"a sequence of {n} tokens needs {len(block_ids)} KV blocks, the engine "
                         f"has {pool.shape.num_blocks}")
    kv_layers = [pool.layer(i) for i in range(pool.shape.num_layers)]
    tokens = torch.tensor(list(token_ids), dtype=torch.int64, device=model.device)
    out = []
    for start in range(0, n, chunk_rows):
        count = min(chunk_rows, n - start)
        batch = AttentionBatch(np.array([start]), np.array([count]), np.array([len(block_ids)]),
                               block_ids, pool.shape.block_size)
        hidden = model.forward(tokens[start:start + count], kv_layers, backend,
                               backend.prepare(batch))  # [count, hidden]
        lo, hi = max(start, first), min(start + count, last)  # wanted rows in this chunk
        if lo < hi:
            out.append(model.logits(hidden[lo - start:hi - start]).cpu())  # [hi - lo, vocab]
    return torch.cat(out)


def window_logprobs(engine: LLMEngine, token_ids: Sequence[int], chunk_rows: int) -> torch.Tensor:
    """log p(token i | tokens < i) for i in [n / 2, n) of one window: fp32 [n - n / 2]."""
    n, half = len(token_ids), len(token_ids) // 2
    logits = position_logits(engine, token_ids, half - 1, n - 1, chunk_rows)  # predict [half, n)
    targets = torch.tensor(list(token_ids[half:]), dtype=torch.int64)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def perplexity(engine: LLMEngine, token_ids: Sequence[int], n_ctx: int = 512,
               stride: int | None = None, chunk_rows: int | None = None) -> PerplexityResult:
    """exp(mean NLL) over the second halves of sliding windows (see the module docstring)."""
    stride = stride or n_ctx // 2
    chunk_rows = chunk_rows or n_ctx
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    starts = window_starts(len(token_ids), n_ctx, stride)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in starts:
            logprobs = window_logprobs(engine, token_ids[start:start + n_ctx], chunk_rows)
            total -= float(logprobs.double().sum())
            count += len(logprobs)
    mean_nll = total / count
    return PerplexityResult(math.exp(mean_nll), mean_nll, count, len(starts))
