"""`justapi serve`'s default KV cache on CPU (f16) end to end: the CPU workers map one f16
shared pool (the banner says so, with twice the blocks `--kv-cache-dtype float32` holds in the
same memory), greedy tokens are the in-process engine's over an f16 pool of its own, and every
block is freed. The kernels' arithmetic is in tests/workers/test_cpu_kernels.py; that
bfloat16 stays selectable, in tests/config/test_serve_config.py."""
from __future__ import annotations

import asyncio
import re
import signal

import pytest

from justapi.client import AsyncClient
from justapi.sampling import SamplingParams
from tools.harness import TINY_MODEL, ServedPool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPTS = [f"request {i}: " + "the quick fox " * (i % 5) for i in range(10)]
MAX_TOKENS = 12


async def complete_all(endpoint: str) -> list[list[int]]:
    async with AsyncClient(endpoint) as client:
        done = await asyncio.gather(*(client.complete(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                                      for p in PROMPTS))
    return [c.token_ids for c in done]


def served(kv_cache_dtype: str) -> tuple[list[list[int]], int]:
    """(greedy tokens per prompt, the pool's blocks as the banner states them)."""
    with ServedPool("--model", TINY_MODEL, "--max-seqs", "8", "--weights", "fp32", "--kv-memory-fraction", "0.00005",
                    "--kv-cache-dtype", kv_cache_dtype, zmq=True) as pool:
        assert pool.zmq is not None
        tokens = asyncio.run(complete_all(pool.zmq))
        assert pool.settled_metrics(["justapi:kv_cache_usage_perc"])["justapi:kv_cache_usage_perc"] == 0.0
        want = "float16" if kv_cache_dtype == "auto" else kv_cache_dtype
        banner = re.search(r"(\d+) blocks x 16 tokens, \d+ MiB (\w+) shared by the CPU workers", pool.log())
        assert banner is not None and banner.group(2) == want, pool.log()
        assert pool.stop(signal.SIGTERM) == 0, pool.log()
        assert pool.leftovers() == []
    return tokens, int(banner.group(1))


def engine_tokens(kv_cache_dtype: str) -> list[list[int]]:
    from workers.engine import LLMEngine

    engine = LLMEngine(TINY_MODEL, progress=False, weights="fp32", kv_cache_dtype=kv_cache_dtype)
    try:
        assert engine.pool.tensor.dtype.is_floating_point and engine.pool.tensor.element_size() == 2
        want = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        engine.close()
    return [o.token_ids for o in want]


def test_a_16_bit_pool_serves_the_engines_tokens_in_half_the_bytes_a_block():
    tokens, blocks = served("auto")
    assert tokens == engine_tokens("float16")
    _, fp32_blocks = served("float32")
    # the same memory fraction of free memory, which moves between the two starts on a shared host
    # (235 / 105 seen): a pool sized in the wrong dtype would hold about as many blocks as fp32's
    assert 1.5 < blocks / fp32_blocks < 2.6
