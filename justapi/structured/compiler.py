"""Compiles grammars off the step loop: a small thread pool (llguidance drops the GIL while it
compiles) and a cache of compiled prototypes keyed by StructuredOutput.key, so n choices or
repeated schemas compile once; each request matches with its own deep copy (about 2 us).

The tokenizer is built on first use, in the pool (0.3-1.6 s), and warmed with one mask (the
first mask of a process costs ~10 ms). A failed compile is cached too: it fails the same way.
`on_done` is called (in a pool thread) after every compile, so a loop blocked on its sockets
can wake up for it. Owns: the pool, the cache and their counters. Does not own: per-request
matchers (matcher.py) or the grammar text (grammar.py).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance as llg
import llguidance.numpy as lnp
import numpy as np

from justapi.sampling import StructuredOutput
from justapi.structured.grammar import grammar_text, parser_limits, short_error

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used ones are dropped)."""


@dataclass(frozen=True)
class Compiled:
    """A compile's outcome: a prototype matcher to deep-copy, or why there is none."""

    prototype: llg.LLMatcher | None
    error: str = ""


class GrammarCompiler:
    def __init__(self, tokenizer_source: Callable[[], llg.LLTokenizer], num_threads: int = 1,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 on_done: Callable[[], None] | None = None) -> None:
        self._tokenizer_source = tokenizer_source
        self._tokenizer: llg.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, ...], Future[Compiled]] = OrderedDict()
        self.cache_size = cache_size
        self.on_done = on_done
        self.num_hits = 0
        self.num_misses = 0
        self.num_compiles = 0  # finished (the counters below are written by pool threads)
        self.compile_seconds = 0.0
        self.max_compile_seconds = 0.0

    def submit(self, structured: StructuredOutput) -> Future[Compiled]:
        """The compile of `structured` (cached, or started now)."""
        key = structured.key
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            self.num_hits += 1
        else:
            self.num_misses += 1
            future = self._pool.submit(self._compile, structured)
            self._cache[key] = future
            self._evict()
        if self.on_done is not None:
            on_done = self.on_done
            future.add_done_callback(lambda _: on_done())
        return future

    def compile_now(self, structured: StructuredOutput) -> Compiled:
        """Compile in the caller's thread, bypassing the cache (benchmarks, tests)."""
        return self._compile(structured)

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        """The tokenizer (built now if no compile has built it yet)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = _warmed(self._tokenizer_source())
            return self._tokenizer

    def _compile(self, structured: StructuredOutput) -> Compiled:
        tokenizer = self.tokenizer
        started = time.perf_counter()
        try:
            grammar = grammar_text(structured)
        except ValueError as exc:
            return Compiled(None, str(exc))
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        elapsed = time.perf_counter() - started
        self.num_compiles += 1
        self.compile_seconds += elapsed
        self.max_compile_seconds = max(self.max_compile_seconds, elapsed)
        if matcher.is_error():
            return Compiled(None, f"{structured.kind}: {short_error(matcher.get_error())}")
        return Compiled(matcher)

    def _evict(self) -> None:
        while len(self._cache) > self.cache_size:
            key, future = next(iter(self._cache.items()))
            if not future.done():
                return  # the oldest is still compiling: drop it later
            del self._cache[key]

    def stats(self) -> dict[str, float]:
        lookups = self.num_hits + self.num_misses
        return {
            "structured_cache_hits": self.num_hits,
            "structured_cache_misses": self.num_misses,
            "structured_cache_hit_ratio": self.num_hits / lookups if lookups else 0.0,
            "structured_compiles": self.num_compiles,
            "structured_compile_seconds": self.compile_seconds,
            "structured_compile_max_seconds": self.max_compile_seconds,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _warmed(tokenizer: llg.LLTokenizer) -> llg.LLTokenizer:
    """Pay the process's one-time mask warm-up here, not in a step."""
    matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_regex("[a-z]+"), log_level=0)
    mask = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)
    lnp.fill_next_token_bitmask(matcher, mask)
    return tokenizer
