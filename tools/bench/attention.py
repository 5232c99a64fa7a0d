"""The CPU decode attention kernel over an fp32, a bf16 and an f16 KV pool, in turns.

    python -m tools.bench attention --shapes 16x600,1x1000,64x100 --layers 30 [--dtypes bfloat16,float16]
    python -m tools.bench attention --chunks 16x26@510,1x256@512,1x256@0 --layers 8

`--chunks` (sequences x rows @ cached keys) times steps of prompt chunks over a bf16 pool
instead: the kernel with fp32 products, with bf16 products (AVX512-BF16 builds), and torch's
SDPA (the kernel off), in turns, with each one's time over the first's.

Per shape (sequences x keys, SmolLM2's heads by default) each pool dtype gets `--layers` pools
of its own, filled at random and with the sequences' blocks scattered as a running server's
would be, and one call per layer is timed, the dtypes taking turns round by round: so the K/V
come from memory as inside a step (a layer's pool is out of the caches by the time it is read
again), not from a cache that one repeated call would warm. Prints the median ms per layer
call per dtype and their ratio. Owns: the harness. Does not own: the kernel
(workers/model/csrc/paged_attention.c).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from workers.model import cpu_kernels
from workers.model.attention import AttentionBatch, TorchCpuBackend

CLOCK = [time.perf_counter]
"""What is timed: wall time, or with --cpu-time this process's CPU time (on a host loaded by
others, one thread's CPU time counts the work, not the waits for a core)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_times(seqs: int, keys: int, dtypes: list[str], layers: int, rounds: int, heads: int, kv_heads: int,
                head_dim: int, block_size: int = 16, seed: int = 0) -> dict[str, float]:
    """Median seconds of one layer's decode attention call per pool dtype."""
    rng = np.random.default_rng(seed)
    blocks = -(-(keys + 1) // block_size)
    num_blocks = seqs * blocks + 4
    block_ids = rng.permutation(num_blocks)[:seqs * blocks]
    batch = AttentionBatch(np.full(seqs, keys), np.ones(seqs, dtype=np.int64), np.full(seqs, blocks), block_ids,
                           block_size)
    backend = TorchCpuBackend(block_size)
    if backend.kernel is None:
        raise SystemExit("the CPU attention kernel did not build here (see the warning above)")
    meta = backend.prepare(batch)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seqs, heads, head_dim, generator=gen)
    pools = {name: [torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DTYPES[name])
                    for _ in range(layers)] for name in dtypes}
    times: dict[str, list[float]] = {name: [] for name in dtypes}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up
            for name in dtypes:
                start = CLOCK[0]()
                for kv in pools[name]:
                    backend.attend(kv, q, meta)
                times[name].append((CLOCK[0]() - start) / layers)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def _variant(name: str, block_size: int) -> TorchCpuBackend:
    if name == "sdpa":
        return TorchCpuBackend(block_size, use_kernel=False)
    backend = TorchCpuBackend(block_size)
    native = backend.kernel
    if native is None:
        raise SystemExit("the CPU attention kernel did not build here (see the warning above)")
    backend.kernel = cpu_kernels.PagedAttentionKernel(native.library, bf16_products=name == "bf16 products")
    return backend


def chunk_variants() -> list[str]:
    """What --chunks compares here: the kernel's product forms this build has, then SDPA."""
    native = cpu_kernels.paged_attention()
    forms = ["fp32 products", "bf16 products"] if native is not None and native.can_pair else ["fp32 products"]
    return forms + ["sdpa"]


def chunk_times(seqs: int, rows: int, cached: int, variants: list[str], layers: int, rounds: int, heads: int,
                kv_heads: int, head_dim: int, block_size: int = 16, seed: int = 0) -> dict[str, float]:
    """Median seconds of one layer's attention over a bf16 pool for `seqs` chunks of `rows` tokens
    after `cached` keys each, per variant (chunk_variants' names), the variants in turns."""
    rng = np.random.default_rng(seed)
    blocks = -(-(cached + rows) // block_size)
    num_blocks = seqs * blocks + 4
    batch = AttentionBatch(np.full(seqs, cached), np.full(seqs, rows), np.full(seqs, blocks),
                           rng.permutation(num_blocks)[:seqs * blocks], block_size)
    backends = {name: _variant(name, block_size) for name in variants}
    metas = {name: backend.prepare(batch) for name, backend in backends.items()}
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seqs * rows, heads, head_dim, generator=gen)
    pools = [torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
             for _ in range(layers)]
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up
            for name, backend in backends.items():
                start = CLOCK[0]()
                for kv in pools:
                    backend.attend(kv, q, metas[name])
                times[name].append((CLOCK[0]() - start) / layers)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench attention", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x1000,4x300,16x200,16x600,64x100",
                        help="sequences x keys, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--cpu-time", action="store_true", help="time this process's CPU time, not the wall "
                        "(with --threads 1: the work, whatever else runs on the host)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim (SmolLM2's)")
    parser.add_argument("--chunks", default="", help="sequences x rows @ cached keys, comma-separated "
                        "(e.g. 16x26@510,1x256@0): prompt chunks over a bf16 pool, kernel vs SDPA")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK[0] = time.process_time
    heads, kv_heads, head_dim = (int(v) for v in args.heads.split(","))
    if args.chunks:
        variants = chunk_variants()
        print(f"torch threads {torch.get_num_threads()}; heads {heads}, KV heads {kv_heads}, head_dim {head_dim}; "
              f"bf16 pool; median ms per layer call over {args.rounds} rounds of {args.layers} layers, in turns")
        for shape in args.chunks.split(","):
            counts, _, cached = shape.partition("@")
            seqs, rows = (int(v) for v in counts.split("x"))
            median = chunk_times(seqs, rows, int(cached or 0), variants, args.layers, args.rounds, heads, kv_heads,
                                 head_dim)
            first = median[variants[0]]
            figures = "  ".join(f"{name} {median[name] * 1e3:7.3f} ({median[name] / first:.2f})" for name in variants)
            print(f"{shape:>12}: {figures}")
        return
    print(f"torch threads {torch.get_num_threads()}; heads {heads}, KV heads {kv_heads}, head_dim {head_dim}; "
          f"median ms per layer call over {args.rounds} rounds of {args.layers} layers, dtypes in turns")
    for shape in args.shapes.split(","):
        seqs, keys = (int(v) for v in shape.split("x"))
        median = layer_times(seqs, keys, dtypes, args.layers, args.rounds, heads, kv_heads, head_dim)
        figures = "  ".join(f"{name} {median[name] * 1e3:7.3f}" for name in dtypes)
        ratio = f"  {dtypes[0]}/{dtypes[-1]} {median[dtypes[0]] / median[dtypes[-1]]:.2f}x" if len(dtypes) > 1 else ""
        print(f"{shape:>9}: {figures}{ratio}")


if __name__ == "__main__":
    main()
