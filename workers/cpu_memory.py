"""Keep freed heap memory in a CPU process instead of handing it back to the kernel.

Every CPU step allocates and frees the same large temporaries (gathered K/V, attention and
matmul outputs: a few MiB each). glibc's malloc serves such blocks with mmap, or trims them
off the top of the heap when freed, so each step maps fresh pages and takes a page fault on
every 4 KiB of them. With a tiny model at 64 sequences that was half of a decode step (one
thread: 4.3 -> 2.0 ms). Raising the mmap and trim thresholds keeps the pages: the process
holds its peak working set, which a worker reaches in its first steps anyway.
A load that measured weight-path plans frees what it timed with (`release_freed_memory`), or
the worker would hold that peak (40-90 MiB for a small model) for good.
Owns: those malloc calls. Does nothing on other C libraries (musl, macOS): they lack mallopt
or these parameters, and the step stays correct, only slower.
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit; larger blocks (the KV pool, weights) are
still mapped on their own and returned when freed."""
TRIM_THRESHOLD_BYTES = 1 << 30

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set the thresholds once per process; True when the C library took them."""
    global _applied
    if _applied is None:
        try:  # the process's own symbols: libc is loaded already (no library search needed)
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            _applied = False
        else:
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            mallopt.restype = ctypes.c_int
            _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _applied


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc's malloc_trim); False where the
    C library has no such call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
