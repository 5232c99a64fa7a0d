"""`justapi perplexity`: perplexity of a GGUF model on a text file, for each weight path
(--paths fp32,bf16,q4,auto).

Sliding windows as llama.cpp's perplexity tool: n_ctx tokens every `stride` tokens (default
n_ctx / 2), each window a fresh sequence, only its second half scored (workers/model/perplexity.py).
`--chunk-rows N` computes each window N tokens at a time through the KV cache: with a small N,
`auto` takes its int4 path as decode steps do; by default a window is one step (auto: fp32).
The data plane (workers, torch) is imported inside the command: `import justapi` stays torch-free.
Owns: this command line and its report lines. Does not own: the windows
(workers/model/perplexity.py).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from workers.model.perplexity import PerplexityResult

PROG = "justapi perplexity"
DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "prose.txt"


@click.command("perplexity")
@click.option("--model", default="", help="GGUF path (default: SmolLM2-135M-Instruct).")
@click.option("--text", "text_path", default=str(DEFAULT_TEXT),
              show_default="justapi/ops/data/prose.txt", help="UTF-8 text file.")
@click.option("--n-ctx", type=click.IntRange(min=2), default=512, show_default=True,
              help="Tokens per window.")
@click.option("--stride", type=click.IntRange(min=0), default=0, help="0: n_ctx / 2.")
@click.option("--chunk-rows", type=click.IntRange(min=0), default=0,
              help="Tokens per step; 0: a whole window.")
@click.option("--paths", default="fp32,q4,auto", show_default=True,
              help="Weight paths, comma-separated; the first is the baseline.")
@click.option("--kv-cache-dtypes", default="auto", show_default=True,
              help="KV cache dtypes (auto, float32, bfloat16, float16), comma-separated: each weight path "
                   "is scored with each.")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda[:N]")
def perplexity(model: str, text_path: str, n_ctx: int, stride: int, chunk_rows: int, paths: str,
               kv_cache_dtypes: str, device: str) -> None:
    """Perplexity of a GGUF model on a text, per weight path and KV cache dtype.

    Sliding windows as llama.cpp's perplexity tool; the first (path, KV dtype) is the baseline.

    Exit status 1, with one line on stderr, for a text or model that cannot be read.
    """
    try:
        text = Path(text_path).read_text(encoding="utf-8")
        click.echo(f"text {text_path}; n_ctx {n_ctx}, stride {stride or n_ctx // 2}, "
                   f"chunk rows {chunk_rows or n_ctx}; load average {os.getloadavg()[0]:.2f}")
        baseline = None
        kv_names = kv_cache_dtypes.split(",")
        names = [f"{path}/{kv}" if len(kv_names) > 1 else path for path in paths.split(",") for kv in kv_names]
        for name in names:
            path, _, kv = name.partition("/")
            score, num_tokens, elapsed = _score(model, device, path, kv or kv_names[0], text,
                                                (n_ctx, stride, chunk_rows))
            baseline = baseline or score.perplexity
            click.echo(f"{name:>5}: perplexity {score.perplexity:9.4f} "
                       f"({100 * (score.perplexity / baseline - 1):+.3f}% vs {names[0]}), "
                       f"{score.num_scored} tokens scored in {score.num_windows} windows of "
                       f"{num_tokens}, {elapsed:.1f} s")
    except (ValueError, RuntimeError, OSError) as exc:
        click.echo(f"{PROG}: error: {' '.join(str(exc).split()) or type(exc).__name__}", err=True)
        sys.exit(1)


def _score(model: str, device: str, weights: str, kv_cache_dtype: str, text: str,
           window: tuple[int, int, int]) -> tuple[PerplexityResult, int, float]:
    """(perplexity result, tokens in the text, seconds) with `weights` loaded fresh."""
    from workers.engine import LLMEngine  # the data plane: torch loads here, not at import
    from workers.model.perplexity import perplexity as windows_perplexity

    n_ctx, stride, chunk_rows = window
    engine = LLMEngine(model, device=device, weights=weights, progress=False,
                       num_blocks=-(-n_ctx // 16) + 1, max_seqs=1, kv_cache_dtype=kv_cache_dtype)
    try:
        ids = engine.encode(text)
        start = time.perf_counter()
        result = windows_perplexity(engine, ids, n_ctx, stride or None, chunk_rows or None)
        return result, len(ids), time.perf_counter() - start
    finally:
        engine.close()
