"""Native CPU kernels (workers/model/csrc/*.c): compiled on first use with the system C compiler,
cached per user and per CPU, loaded with ctypes.

A kernel that cannot be built (no compiler, or JUSTAPI_CPU_KERNELS=0) leaves its caller on
the plain torch path, with one warning. Owns: building, caching and calling the kernels.
Does not own: the attention metadata (attention.py) or the pool (kv_pool.py).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch

from workers.model.kernel_records import (CACHE_ENV, QUIET_SHARE, SOURCE_DIR, BusyProbe,  # noqa: F401
                                          KernelBuildError, cache_dir, cpu_id, cpu_name, locked, read_json,
                                          write_json)

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-trapping-math")
"""-march=native: the build is for this CPU (the cache key holds its flags). -fopenmp links
libgomp.so.1, the same soname torch loads, so the kernel shares torch's one thread pool.
-fno-trapping-math: nothing here unmasks floating-point traps, and without it GCC keeps the
selects of the polynomial exp (csrc/exp_nonpositive.h) as branches and leaves its loops
scalar (the gated activation 3-5x slower than torch's at 16-256 rows); results are unchanged
(unlike -ffast-math, it licenses no reassociation)."""
KEEP_UNUSED_DAYS = 30
"""A cached build no start has used for this long is removed at the next build (prune)."""
MARK_USED_AFTER_S = 86400
ENABLE_ENV = "JUSTAPI_CPU_KERNELS"
BAD_BLOCK, BAD_SHAPE = -2, -3  # paged_attention.c's status codes (OUT_OF_MEMORY = -1)
PRODUCTS_ENV = "JUSTAPI_CPU_ATTENTION_PRODUCTS"
"""bf16 | fp32 | auto (unset): the bf16 pool's products in the attention kernel, where the CPU
has AVX512-BF16 (auto: whichever measured faster on this CPU, see choose_bf16_products)."""
PAIRS_MARGIN = 0.95
"""auto takes bf16 products only where they took at most this share of the fp32 products' time
(a near tie keeps the exact products)."""


def build(name: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """workers/model/csrc/<name>.c -> a shared library in the cache (compiled once per source and
    the headers beside it, compiler, flags and CPU; concurrent builders each write a temporary
    file, then rename it). `extra_flags` follow FLAGS (tests build without some of the CPU's
    features, e.g. -mno-avx512f, to run the paths other CPUs take)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise KernelBuildError(f"no C compiler: {os.environ.get('CC', 'cc')!r} is not on PATH")
    source = SOURCE_DIR / f"{name}.c"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = [path.read_text() for path in sorted(SOURCE_DIR.glob("*.h"))]  # what it may include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, version, " ".join(FLAGS + extra_flags),
                                    cpu_id()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if out.exists():
        _mark_used(out)
        return out
    prune(out.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, *extra_flags, str(source), "-o", tmp, "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[0]
            raise KernelBuildError(f"{Path(compiler).name} failed on {source.name}: {first}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _mark_used(library: Path) -> None:
    """Refresh a cached build's time (at most once a day, so a hit costs no write): prune keeps
    what a start used lately."""
    try:
        if time.time() - library.stat().st_mtime > MARK_USED_AFTER_S:
            os.utime(library)
    except OSError:
        pass


def prune(directory: Path, now: float | None = None) -> list[Path]:
    """Remove the builds in the cache that no start has used for KEEP_UNUSED_DAYS (other source
    versions', compilers' or CPUs', and a crashed build's temporary file), with the records kept
    beside them; returns the libraries removed. Called before each new build, so the cache holds
    what is in use plus what changed in the last KEEP_UNUSED_DAYS. A process that has a library
    loaded keeps it when its file goes."""
    cutoff = (time.time() if now is None else now) - KEEP_UNUSED_DAYS * 86400
    removed = []
    for library in directory.glob("*.so"):
        try:
            if library.stat().st_mtime >= cutoff:
                continue
            library.unlink()
        except OSError:
            continue
        removed.append(library)
        record = products_record(library)
        for path in (record, record.with_name(record.name + ".lock")):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
    if removed:
        log.info("removed %d kernel build(s) unused for %d days from %s", len(removed), KEEP_UNUSED_DAYS, directory)
    return removed


class PagedAttentionKernel:
    """workers/model/csrc/paged_attention.c's paged_attention_short (an fp32 pool),
    paged_attention_short_bf16[_pairs] (a bfloat16 pool) and paged_attention_short_f16 (a float16
    pool), called with torch tensors."""

    SYMBOLS = {torch.float32: "paged_attention_short", torch.bfloat16: "paged_attention_short_bf16",
               torch.float16: "paged_attention_short_f16"}
    PAIRS_SYMBOL = "paged_attention_short_bf16_pairs"
    """The entry points per pool dtype, and the bf16 pool's with bf16 products (the layer chain
    takes their addresses: `symbol`)."""

    def __init__(self, library: ctypes.CDLL, bf16_products: bool | None = None) -> None:
        ptr, i64p = ctypes.c_void_p, ctypes.c_void_p
        self._fns = {}
        for key, name in [*self.SYMBOLS.items(), ("pairs", self.PAIRS_SYMBOL)]:
            fn = getattr(library, name)
            fn.argtypes = [ptr, ptr, i64p, ptr, i64p, i64p, ptr, i64p, ctypes.c_float, ctypes.c_float,
                           ctypes.c_int]
            fn.restype = ctypes.c_int
            self._fns[key] = fn
        self.library = library
        library.paged_attention_lanes.argtypes = [ctypes.c_int64]
        self._lanes = library.paged_attention_lanes
        self.can_pair = bool(library.paged_attention_bf16_products())
        """Whether this build has the bf16 products (AVX512-BF16)."""
        self.bf16_products = self.can_pair if bf16_products is None else bf16_products and self.can_pair
        """Whether rows over a bf16 pool (head_dim a multiple of 32, up to 256) round the query
        and the probabilities to bf16 and multiply bf16 pairs (paged_attention() measures which
        is faster here: choose_bf16_products)."""

    def symbol(self, dtype: torch.dtype) -> str:
        """The entry point this kernel calls for a pool of `dtype`."""
        return self.PAIRS_SYMBOL if dtype == torch.bfloat16 and self.bf16_products else self.SYMBOLS[dtype]

    def lanes_loop(self, head_dim: int) -> bool:
        """Whether rows over a bf16 or f16 pool of this head_dim take the keys-in-lanes loop
        (AVX-512 builds: head_dim a multiple of 32, up to 256)."""
        return bool(self._lanes(head_dim))

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor,
                 num_keys: torch.Tensor, num_rows: torch.Tensor, scale: float | None = None,
                 softcap: float = 0.0, pairs: bool | None = None) -> torch.Tensor:
        """q [A, Qmax, heads, head_dim] fp32; kv [2, num_blocks, block_size, kv_heads, head_dim]
        fp32, bf16 or f16 (widened exactly as it is read; the 16-bit pools' loops sum in their own
        fixed order, and with bf16_products a bf16 pool's rounds the query and the probabilities
        to bf16);
        tables [A, Bmax] int64; mask [A, Qmax, Bmax * block_size] bool; num_keys, num_rows [A]
        int64 -> out like q (rows past num_rows[a] undefined). Scores are
        q . k * scale (default 1 / sqrt(head_dim)), soft-capped when softcap > 0. `pairs`
        overrides bf16_products for this call."""
        num_seqs, q_max, heads, head_dim = q.shape
        _, num_blocks, block_size, kv_heads, kv_dim = kv.shape
        assert kv_dim == head_dim and heads % kv_heads == 0 and q.dtype == torch.float32 and kv.dtype in self.SYMBOLS
        assert mask.shape == (num_seqs, q_max, tables.shape[1] * block_size)
        assert kv.is_contiguous(), "a pool layer is contiguous (a copy would cost the whole layer)"
        q, tables, mask, num_keys, num_rows = (t.contiguous() for t in (q, tables, mask, num_keys, num_rows))
        out = torch.empty_like(q)
        dims = np.array([num_seqs, q_max, heads, kv_heads, head_dim, block_size, tables.shape[1],
                         num_blocks], dtype=np.int64)  # (torch.tensor of 8 ints cost ~10 us a call)
        pairs = self.bf16_products if pairs is None else pairs
        fn = self._fns["pairs" if pairs and kv.dtype == torch.bfloat16 else kv.dtype]
        status = fn(q.data_ptr(), kv.data_ptr(), tables.data_ptr(), mask.data_ptr(),
                          num_keys.data_ptr(), num_rows.data_ptr(), out.data_ptr(), dims.ctypes.data,
                          head_dim ** -0.5 if scale is None else scale, softcap,
                          torch.get_num_threads())
        if status == BAD_BLOCK:
            raise ValueError(f"a block table names a block outside the pool's {num_blocks} "
                             f"(largest id {int(tables.max())})")
        if status == BAD_SHAPE:
            raise ValueError(f"a sequence's keys run past its block table of {tables.shape[1]} "
                             f"blocks (most keys {int(num_keys.max())}), or its rows past {q_max}")
        if status != 0:
            raise MemoryError("paged attention kernel: out of memory for its scratch buffers")
        return out


K = TypeVar("K")


def load_kernel(name: str, wrap: Callable[[ctypes.CDLL], K], fallback: str) -> K | None:
    """csrc/<name>.c built and loaded, wrapped by `wrap`; None where the kernels are turned off
    (JUSTAPI_CPU_KERNELS=0) or cannot be built here, with one warning saying `fallback`
    (what runs instead)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    try:
        return wrap(ctypes.CDLL(str(build(name))))
    except (KernelBuildError, OSError) as exc:
        log.warning("CPU kernel %s unavailable, %s: %s", name, fallback, exc)
        return None


def _products_timings(kernel: PagedAttentionKernel, rounds: int = 5) -> tuple[float, float]:
    """Seconds of (fp32 products, bf16 products) over a bf16 pool: the best of `rounds`, the modes
    in turns, of one pass over three steps of a small model's layer (8 query heads over 2 KV
    heads of 64): 16 decodes over 512 keys each, 16 sharing 512 keys plus 32 of their own, and
    4 chunks of 32 rows after 512 keys."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    steps = []
    for num_seqs, rows, start, shared in ((16, 1, 511, 0), (16, 1, 543, 32), (4, 32, 512, 0)):
        blocks = -(-(start + rows) // block_size)
        own = blocks - shared
        tables = torch.arange(num_seqs * own).reshape(num_seqs, own) + shared
        tables = torch.cat([torch.arange(shared).expand(num_seqs, shared), tables], dim=1).contiguous()
        kv = torch.randn(2, shared + num_seqs * own, block_size, kv_heads, head_dim, generator=gen).bfloat16()
        q = torch.randn(num_seqs, rows, heads, head_dim, generator=gen)
        keys = torch.arange(blocks * block_size)
        mask = (keys[None, None, :] <= start + torch.arange(rows)[None, :, None]).expand(num_seqs, rows, -1)
        steps.append((q, kv, tables, mask.contiguous(), torch.full((num_seqs,), start + rows),
                      torch.full((num_seqs,), rows)))
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for mode in (0, 1):
            began = time.perf_counter()
            for step in steps:
                kernel(*step, pairs=bool(mode))
            best[mode] = min(best[mode], time.perf_counter() - began)
    return best[0], best[1]


def products_record(library_path: Path) -> Path:
    """The record of the products' choice beside a build of paged_attention.c."""
    return library_path.with_name(library_path.stem + ".products.json")


def choose_bf16_products(kernel: PagedAttentionKernel, library_path: Path) -> bool:
    """Whether the bf16 pool's attention takes bf16 products here: JUSTAPI_CPU_ATTENTION_PRODUCTS
    where set, else measured once per CPU, build and thread count (_products_timings: they halve
    the multiply-adds, but on some CPUs vdpbf16ps issues on fewer ports than fp32 FMAs and the
    pairs loop was 5-30% slower) and recorded beside the library under its lock, so every
    process on this machine computes the same bits. A measurement is recorded only where two
    passes agree and the host was quiet while they ran (kernel_records.BusyProbe); otherwise it
    holds for this process only."""
    if not kernel.can_pair:
        return False
    forced = os.environ.get(PRODUCTS_ENV, "auto")
    if forced in ("bf16", "fp32"):
        return forced == "bf16"
    if forced != "auto":
        log.warning("%s=%r is not bf16, fp32 or auto: measuring", PRODUCTS_ENV, forced)
    record, threads = products_record(library_path), str(torch.get_num_threads())
    try:
        with locked(record):  # one process measures; the rest read its record
            recorded = read_json(record).get(threads)
            if isinstance(recorded, dict) and recorded.get("choice") in ("bf16", "fp32"):
                return recorded["choice"] == "bf16"
            choice, entry = _measure_products(kernel)
            if entry is not None:
                entries = read_json(record)
                entries[threads] = entry
                write_json(record, entries)
            return choice
    except OSError as exc:  # no record here: this process measures for itself
        log.warning("cannot record the attention products' choice beside %s: %s", library_path.name, exc)
        return _measure_products(kernel)[0]


def _measure_products(kernel: PagedAttentionKernel) -> tuple[bool, dict | None]:
    """(bf16 products?, the record's entry, or None where it is not to be kept): two passes in
    turns; the choice stands if both make it, else fp32 (the exact products) for this process."""
    probe = BusyProbe().start()
    passes = [_products_timings(kernel) for _ in range(2)]
    choices = {"bf16" if pairs <= PAIRS_MARGIN * fp32 else "fp32" for fp32, pairs in passes}
    fp32, pairs = min(t[0] for t in passes), min(t[1] for t in passes)
    agree, busy = len(choices) == 1, probe.share()
    choice = choices.pop() if agree else "fp32"
    kept = agree and busy <= QUIET_SHARE
    log.info("CPU attention over a bf16 pool: %s products (fp32 %.3f ms, bf16 %.3f ms; other processes "
             "%.0f%% of the CPUs%s)", choice, fp32 * 1e3, pairs * 1e3, busy * 100,
             "" if kept else ": for this process only, measured again at the next start")
    entry = {"choice": choice, "fp32_ms": round(fp32 * 1e3, 3), "bf16_ms": round(pairs * 1e3, 3),
             "threads": torch.get_num_threads(), "cpu": cpu_name(), "measured_at": round(time.time()),
             "others_busy": round(busy, 3)}
    return choice == "bf16", entry if kept else None


def _paged_attention_kernel(library: ctypes.CDLL) -> PagedAttentionKernel:
    kernel = PagedAttentionKernel(library)
    if kernel.can_pair:
        kernel.bf16_products = choose_bf16_products(kernel, build("paged_attention"))  # the path: cached
    return kernel


@functools.cache
def paged_attention() -> PagedAttentionKernel | None:
    """The kernel, or None (with one warning) where it cannot be built here; over a bf16 pool
    with the products choose_bf16_products picks."""
    return load_kernel("paged_attention", _paged_attention_kernel, "using the torch path (slower)")
