"""The native CPU paged-attention kernel against the torch path, its bit-for-bit batch
invariance, and its build cache and fallback (workers/model/cpu_kernels.py). Each arithmetic
test runs over an fp32, a bf16 and an f16 pool (--kv-cache-dtype: the 16-bit pools have loops of
their own)."""
from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import time

import numpy as np
import pytest
import torch

from workers.model import cpu_kernels
from workers.model.cpu_kernels import cpu_id
from workers.model.attention import AttentionBatch, AttentionParams, TorchCpuBackend
from workers.spec.tree import TreeLayout, verify_mask

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "kernels"))
    cpu_kernels.paged_attention.cache_clear()
    yield
    cpu_kernels.paged_attention.cache_clear()


def random_step(starts, rows, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0, tree=None):
    """A pool with random K/V, scattered block tables and random queries for a short-chunk step."""
    rng = np.random.default_rng(seed)
    starts, rows = np.asarray(starts), np.asarray(rows)
    blocks = -(-(starts + rows) // block_size)
    num_pool_blocks = int(blocks.sum()) + 5
    block_ids = rng.permutation(num_pool_blocks)[:blocks.sum()]
    batch = AttentionBatch(starts, rows, blocks, block_ids, block_size, tree=tree)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_pool_blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(int(rows.sum()), heads, head_dim, generator=gen)
    return batch, kv, q


def attend(batch, kv, q, use_kernel=True, params=AttentionParams()):
    backend = TorchCpuBackend(batch.block_size, use_kernel=use_kernel)
    assert (backend.kernel is not None) == use_kernel
    return backend.attend(kv, q, backend.prepare(batch), params)


KV_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16],
                                    ids=["fp32", "bf16", "f16"])

PAIRS_ATOL = 2.5e-2
"""Kernel against fp32 attention over the same bf16 pool where the build multiplies bf16 pairs
(AVX512-BF16): the query and the probabilities rounded to bf16 (a relative 2^-9 each) moved
these outputs (values ~N(0, 1)) by up to ~1e-2; a wrong key or mask moves them by ~1."""


def native_kernel() -> cpu_kernels.PagedAttentionKernel:
    kernel = cpu_kernels.paged_attention()
    assert kernel is not None, "the CPU kernel did not build (see the warning)"
    return kernel


def atol(kv_dtype, head_dim, fp32_atol=2e-6, kernel=None):
    """The bound a kernel row keeps to the fp32 torch path: fp32_atol, or PAIRS_ATOL where the
    kernel (default: this machine's build) multiplies bf16 pairs for this pool and head_dim."""
    pairs = (kernel or native_kernel()).bf16_products and kv_dtype == torch.bfloat16
    return PAIRS_ATOL if pairs and head_dim % 32 == 0 and head_dim <= 256 else fp32_atol


SHAPES = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),   # SmolLM2-135M
    (4, 4, 16, 1),    # no GQA, one slot per block
    (8, 2, 24, 4),    # head_dim not a multiple of the kernel's 16 lanes
    (4, 2, 128, 32),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@KV_DTYPES
def test_kernel_equals_the_gathered_torch_path(heads, kv_heads, head_dim, block_size, kv_dtype):
    """Decodes and multi-row chunks (verification), at scattered blocks, mid-block and at
    block boundaries."""
    starts = [0, 5, block_size * 3, 37, 100, 2, 63]
    rows = [1, 1, 1, 4, 16, 3, 1]
    batch, kv, q = random_step(starts, rows, heads, kv_heads, head_dim, block_size)
    kv = kv.to(kv_dtype)
    got, want = attend(batch, kv, q), attend(batch, kv, q, use_kernel=False)
    assert got.shape == want.shape == q.shape
    torch.testing.assert_close(got, want, atol=atol(kv_dtype, head_dim), rtol=0)


HALF_DTYPES = pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@HALF_DTYPES
def test_over_a_16_bit_pool_the_kernel_attends_to_the_rounded_values(heads, kv_heads, head_dim, block_size, half):
    """--kv-cache-dtype bfloat16 / float16: K/V widened exactly as they are read, so the result is
    the fp32 kernel's on kv16.float() (to the last bits: the 16-bit loops sum in another order;
    with bf16 products, to their rounding), not the fp32 pool's."""
    batch, kv, q = random_step([0, 5, 37, 100, 63], [1, 1, 4, 16, 1], heads, kv_heads, head_dim, block_size)
    kv16 = kv.to(half)
    got = attend(batch, kv16, q)
    torch.testing.assert_close(got, attend(batch, kv16.float(), q), atol=atol(half, head_dim), rtol=0)
    assert not torch.allclose(got, attend(batch, kv, q), atol=1e-4 if half == torch.bfloat16 else 1e-5)


def test_a_f16_pool_is_nearer_the_exact_cache_than_a_bf16_pool():
    """A half keeps 11 significant bits, bf16 8: K/V values (|x| < 65504) lose ~8x less in an
    f16 pool, and so does attention over it (the reason f16 is llama.cpp's default cache)."""
    batch, kv, q = random_step([0, 5, 37, 100, 63], [1, 1, 4, 16, 1], seed=9)
    exact = attend(batch, kv, q)
    errors = {half: float((attend(batch, kv.to(half), q) - exact).abs().max()) for half in (torch.bfloat16, torch.float16)}
    assert errors[torch.float16] * 4 < errors[torch.bfloat16], errors


@KV_DTYPES
def test_kernel_follows_token_tree_masks(kv_dtype):
    """Tree rows see their ancestors only, not their siblings (speculative tree verification)."""
    parents = [-1, 0, 0, 1, 2, 2]  # the drafts' parents (-1: the root, the chunk's first row)
    rows = [1, 1 + len(parents), 1]
    tree = TreeLayout()
    tree.add(verify_mask(seq=1, num_tokens=rows[1], start=20, parents=parents))
    batch, kv, q = random_step([7, 20, 40], rows, tree=tree)
    kv = kv.to(kv_dtype)
    got, want = attend(batch, kv, q), attend(batch, kv, q, use_kernel=False)
    torch.testing.assert_close(got, want, atol=atol(kv_dtype, q.shape[-1]), rtol=0)
    chain, _, _ = random_step([7, 20, 40], rows)
    plain = attend(chain, kv, q)
    draft_2 = 1 + 1 + 2  # sequence 0's row, the root, drafts 0 and 1
    assert torch.equal(plain[:draft_2 - 1], got[:draft_2 - 1])  # root, draft 0: a chain's rows
    assert not torch.allclose(plain[draft_2], got[draft_2])  # without the tree it sees draft 1


def dense_attention(batch, kv, q, params):
    """Each row by hand: its sequence's keys by block table, q . k * scale, soft-cap, the
    causal window, softmax, GQA by repeating K/V heads."""
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // kv.shape[3]
    for seq, (start, count) in enumerate(zip(batch.start_positions, batch.num_tokens)):
        table = batch.block_ids[batch.block_offsets()[seq]:batch.block_offsets()[seq + 1]]
        keys = kv[:, torch.from_numpy(table.astype(np.int64))].flatten(1, 2)  # [2, slots, kvh, d]
        for i in range(count):
            pos = start + i
            visible = [t for t in range(pos + 1) if not params.window or t > pos - params.window]
            k, v = (keys[j, visible].repeat_interleave(group, dim=1) for j in (0, 1))  # [K, heads, d]
            scores = torch.einsum("hd,khd->hk", q[row], k) * params.scale
            scores = params.softcap * torch.tanh(scores / params.softcap)
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
            row += 1
    return out


@KV_DTYPES
def test_scale_softcap_and_window_equal_a_dense_reference(kv_dtype):
    """A layer's attention params (Gemma 2's soft-cap, a sliding window shorter than the
    contexts, a scale other than 1/sqrt(d)) on both paths: short chunks and a long one."""
    params = AttentionParams(scale=0.3, softcap=5.0, window=6)
    batch, kv, q = random_step([0, 5, 37, 100, 9], [1, 1, 4, 16, 20], heads=8, kv_heads=2,
                               head_dim=24, block_size=4, seed=5)
    kv = kv.to(kv_dtype)
    want = dense_attention(batch, kv.float(), q, params)
    for use_kernel in (True, False):
        torch.testing.assert_close(attend(batch, kv, q, use_kernel, params), want, atol=2e-5, rtol=0)
    unwindowed = AttentionParams(scale=0.3, softcap=5.0)
    assert not torch.allclose(attend(batch, kv, q, True, unwindowed), want, atol=1e-3)


@KV_DTYPES
def test_a_window_on_token_tree_rows_is_alike_on_both_paths(kv_dtype):
    parents = [-1, 0, 0, 1, 2, 2]
    rows = [1, 1 + len(parents), 1]
    tree = TreeLayout()
    tree.add(verify_mask(seq=1, num_tokens=rows[1], start=20, parents=parents))
    batch, kv, q = random_step([7, 20, 40], rows, tree=tree)
    kv = kv.to(kv_dtype)
    params = AttentionParams(window=5)
    got, want = attend(batch, kv, q, True, params), attend(batch, kv, q, False, params)
    torch.testing.assert_close(got, want, atol=atol(kv_dtype, q.shape[-1]), rtol=0)
    assert not torch.allclose(got, attend(batch, kv, q), atol=1e-3)


@KV_DTYPES
def test_a_row_is_bit_identical_alone_beside_longer_mates_and_as_a_verification_row(kv_dtype):
    """The torch path differs in the last bits in both cases (padded keys, multi-row SDPA)."""
    batch, kv, q = random_step([30, 200, 90, 500], [4, 1, 1, 1], seed=3)
    kv = kv.to(kv_dtype)
    step = attend(batch, kv, q)
    for i in range(4):  # sequence 0's rows, each decoded alone at its position
        alone = AttentionBatch(np.array([30 + i]), np.array([1]), batch.num_blocks[:1],
                               batch.block_ids[:batch.num_blocks[0]], batch.block_size)
        assert torch.equal(attend(alone, kv, q[i:i + 1])[0], step[i]), i
    mates = AttentionBatch(batch.start_positions[1:], batch.num_tokens[1:], batch.num_blocks[1:],
                           batch.block_ids[batch.num_blocks[0]:], batch.block_size)
    assert torch.equal(attend(mates, kv, q[4:])[1:], step[5:])


@KV_DTYPES
def test_thread_count_does_not_change_a_bit(kv_dtype):
    """With fewer sequences than threads the kernel splits each by KV head."""
    steps = [random_step([300], [1], seed=4), random_step([300, 10, 20, 7], [1, 3, 1, 2], seed=4)]
    before = torch.get_num_threads()
    try:
        for batch, kv, q in steps:
            kv = kv.to(kv_dtype)
            outs = []
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                outs.append(attend(batch, kv, q))
            assert all(torch.equal(out, outs[0]) for out in outs)
    finally:
        torch.set_num_threads(before)


def test_the_build_is_cached_per_source_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    first = cpu_kernels.build("paged_attention")
    built_ns = first.stat().st_mtime_ns
    assert first.parent == tmp_path and first.suffix == ".so"
    assert cpu_kernels.build("paged_attention") == first and first.stat().st_mtime_ns == built_ns
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left


def test_builds_unused_for_a_month_are_pruned_at_the_next_build_and_a_hit_marks_its_build_used(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    month = (cpu_kernels.KEEP_UNUSED_DAYS + 1) * 86400
    old = time.time() - month
    stale = tmp_path / "paged_attention-0123456789abcdef.so"  # another version's build and its records
    record = cpu_kernels.products_record(stale)
    lock = record.with_name(record.name + ".lock")
    recent = tmp_path / "quant_matmul-fedcba9876543210.so"  # used within the month: kept
    for path in (stale, record, lock, recent):
        path.write_bytes(b"x")
    for path in (stale, record, lock):
        os.utime(path, (old, old))
    os.utime(recent, (time.time() - month / 2,) * 2)
    plans = tmp_path / "weight-paths.json"  # records of their own, not builds
    plans.write_text("{}")
    os.utime(plans, (old, old))
    built = cpu_kernels.build("paged_attention")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([built.name, recent.name, plans.name])
    os.utime(built, (old, old))  # a hit on a build older than a day refreshes its time ...
    assert cpu_kernels.build("paged_attention") == built and built.stat().st_mtime > time.time() - 60
    assert cpu_kernels.prune(tmp_path, now=time.time() + month / 2 + 3600) == [recent]  # ... so it outlives the rest


def test_without_a_compiler_the_cpu_backend_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    with caplog.at_level(logging.WARNING, logger="workers.model.cpu_kernels"):
        assert cpu_kernels.paged_attention() is None
    assert "no C compiler: 'no-such-cc'" in caplog.text
    backend = TorchCpuBackend(16)
    assert backend.kernel is None
    batch, kv, q = random_step([3, 40], [1, 2])
    torch.testing.assert_close(backend.attend(kv, q, backend.prepare(batch)),
                               attend(batch, kv, q, use_kernel=False), atol=0, rtol=0)


def test_a_failing_compiler_and_the_off_switch_both_mean_no_kernel(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger="workers.model.cpu_kernels"):
        assert cpu_kernels.paged_attention() is None
    assert "failed on paged_attention.c" in caplog.text and not list(tmp_path.iterdir())
    monkeypatch.delenv("CC")
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0")
    cpu_kernels.paged_attention.cache_clear()
    assert cpu_kernels.paged_attention() is None


def test_a_cache_directory_others_can_write_is_not_used(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(shared))
    assert cpu_kernels.cache_dir() != shared


def test_a_block_id_outside_the_pool_is_an_error_not_a_stray_read():
    batch, kv, q = random_step([3, 40], [1, 1])
    backend = TorchCpuBackend(batch.block_size)
    meta = backend.prepare(batch)
    meta.short.tables[1, 0] = kv.shape[1]  # one past the last block
    with pytest.raises(ValueError, match="outside the pool's"):
        backend.attend(kv, q, meta)
    meta.short.tables[1, 0] = -1
    with pytest.raises(ValueError, match="outside the pool's"):
        backend.attend(kv, q, meta)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_keys_past_the_block_table_or_rows_past_the_batch_are_refused_not_read(kv_dtype):
    """The kernel checks its own bounds: a key count past its sequence's table (the table row
    and the mask row end there) or a row count past the padded batch is refused before
    anything is read; the next good call gives the same bits as before."""
    kernel = native_kernel()
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, max_blocks = 4, 2, 64, 16, 3
    kv = torch.randn(2, 8, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    q = torch.randn(2, 2, heads, head_dim, generator=gen)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    mask = torch.ones(2, 2, max_blocks * block_size, dtype=torch.bool)
    rows = torch.tensor([2, 1])
    good = kernel(q, kv, tables, mask, torch.tensor([40, 48]), rows)
    for num_keys, num_rows in (([40, 49], [2, 1]), ([40, 10**9], [2, 1]), ([-1, 48], [2, 1]),
                               ([40, 48], [3, 1]), ([40, 48], [2, -1])):
        with pytest.raises(ValueError, match="past its block table"):
            kernel(q, kv, tables, mask, torch.tensor(num_keys), torch.tensor(num_rows))
    again = kernel(q, kv, tables, mask, torch.tensor([40, 48]), rows)
    assert torch.equal(again[0, :2], good[0, :2]) and torch.equal(again[1, :1], good[1, :1])


def reference_attention(batch, kv, q, window=0, softcap=0.0):
    """Each row by hand: softmax over the keys it may see (causal, and within the window)."""
    kv_flat = kv.view(2, -1, kv.shape[-2], kv.shape[-1])
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // kv.shape[-2]
    for seq, (start, n) in enumerate(zip(batch.start_positions.tolist(), batch.num_tokens.tolist())):
        table = batch.padded_tables(np.array([seq]))[0]
        key_slots = (torch.from_numpy(table)[:, None] * batch.block_size + torch.arange(batch.block_size)).reshape(-1)
        k = kv_flat[0, key_slots[:start + n]].repeat_interleave(group, dim=1)  # [K, heads, d]
        v = kv_flat[1, key_slots[:start + n]].repeat_interleave(group, dim=1)
        for i in range(n):
            pos = start + i
            visible = torch.arange(start + n) <= pos
            if window:
                visible &= torch.arange(start + n) > pos - window
            scores = torch.einsum("hd,khd->hk", q[row + i].double(), k.double()) * q.shape[-1] ** -0.5
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores[:, ~visible] = float("-inf")
            out[row + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v.double()).float()
        row += n
    return out


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 0.0), (500, 0.0), (0, 30.0)])
def test_long_chunks_attend_causally_with_or_without_a_mask(window, softcap):
    """Long chunks (prefill): a whole prompt with no window reaching into it runs SDPA's causal
    path with no mask; a chunk after a prefix, or one a window cuts into, keeps its mask. Both
    match attention computed row by hand, and the unmasked path gives the masked one's bits."""
    starts, rows = [0, 0, 70], [200, 17, 90]
    batch, kv, q = random_step(starts, rows, seed=3)
    backend = TorchCpuBackend(batch.block_size, use_kernel=False)
    meta = backend.with_window(backend.prepare(batch), window)
    unmasked = [chunk.mask is None for chunk in meta.longs]
    assert unmasked == [not 0 < window < n and start == 0 for start, n in zip(starts, rows)]
    params = AttentionParams(window=window, softcap=softcap)
    got = backend.attend(kv, q, backend.prepare(batch), params)
    torch.testing.assert_close(got, reference_attention(batch, kv, q, window, softcap), atol=2e-5, rtol=0)
    for chunk in meta.longs:  # the same chunks with the causal mask spelled out
        if chunk.mask is None:
            chunk.mask = torch.ones(chunk.num_tokens, chunk.num_keys, dtype=torch.bool).tril()
    masked = backend.attend(kv, q, meta, AttentionParams(softcap=softcap))  # meta: windowed already
    assert torch.equal(got, masked)


@pytest.mark.skipif("avx512f" not in cpu_id(), reason="this CPU has no AVX-512: its build is already the AVX2 one")
@pytest.mark.parametrize("heads,kv_heads,head_dim,same_bits", [(8, 2, 24, True), (8, 2, 48, True),
                                                               (9, 3, 64, False), (4, 1, 128, False)])
@HALF_DTYPES
def test_an_avx2_build_of_the_16_bit_loops(heads, kv_heads, head_dim, same_bits, half):
    """A build for AVX2 CPUs (checked here) runs the tiled loop at every head_dim. Where this
    machine runs it too (head_dim not a multiple of 32), the bits are the same: with AVX-512
    three query heads share each widened key (their sums in 32 registers), with AVX2's 16
    registers one head at a time, the same operations per (key, head) in the same order (KV
    groups of 4 here: 3 + 1 heads a pass). At 64 and 128 this machine runs the keys-in-lanes
    loop, another summation order (with AVX512-BF16, of bf16 products): the same values (within
    that rounding). A decode and a verification chunk; bf16 and f16 pools (F16C's widening)."""
    other = cpu_kernels.PagedAttentionKernel(ctypes.CDLL(str(cpu_kernels.build("paged_attention", ("-mno-avx512f",)))))
    batch, kv, q = random_step([0, 37, 100, 9], [1, 4, 1, 16], heads, kv_heads, head_dim, seed=6)
    kv16 = kv.to(half)
    backend = TorchCpuBackend(batch.block_size)
    want = backend.attend(kv16, q, backend.prepare(batch))
    backend.kernel = other
    got = backend.attend(kv16, q, backend.prepare(batch))
    if same_bits:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=atol(half, head_dim), rtol=0)
        assert not torch.equal(got, want)  # the keys-in-lanes loop did run here


def shared_prefix_step(prefix_blocks, lengths, rows, block_size=16, heads=9, kv_heads=3, head_dim=64, seed=7):
    """Sequences whose block tables start with the same `prefix_blocks` blocks (a cached prompt),
    then blocks of their own; lengths: keys before each sequence's rows."""
    rng = np.random.default_rng(seed)
    lengths, rows = np.asarray(lengths), np.asarray(rows)
    blocks = -(-(lengths + rows) // block_size)
    own = int((blocks - np.minimum(blocks, prefix_blocks)).sum())
    ids = rng.permutation(prefix_blocks + own + 3)
    shared, rest, tables = ids[:prefix_blocks], list(ids[prefix_blocks:]), []
    for n in blocks:
        tables.append(np.concatenate([shared[:n], [rest.pop() for _ in range(max(0, n - prefix_blocks))]]))
    batch = AttentionBatch(lengths, rows, blocks, np.concatenate(tables).astype(np.int64), block_size)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, len(ids), block_size, kv_heads, head_dim, generator=gen).bfloat16()
    return batch, kv, torch.randn(int(rows.sum()), heads, head_dim, generator=gen)


def kernel_build(name: str) -> cpu_kernels.PagedAttentionKernel:
    if name == "f16 pool":
        return kernel_build("fp32 products")
    """This machine's build with its bf16 pool's products fixed: "fp32 products" (what CPUs
    without AVX512-BF16 take, and those with it where they measured faster) or "bf16 products"
    (skipped where this CPU has no AVX512-BF16)."""
    native = native_kernel()
    if name == "bf16 products" and not native.can_pair:
        pytest.skip("this CPU has no AVX512-BF16: its build multiplies in fp32 only")
    return cpu_kernels.PagedAttentionKernel(native.library, bf16_products=name == "bf16 products")


class QuietProbe:
    """kernel_records.BusyProbe on a host where other processes used `share` of the CPUs."""

    share_value = 0.0

    def start(self):
        return self

    def share(self):
        return self.share_value


def test_the_bf16_products_are_what_this_cpu_measured_faster_recorded_beside_the_build(monkeypatch):
    """Where the build has bf16 products, the loaded kernel takes them only if they measured
    faster here, and says so in a record beside the library that every later process reads; the
    bf16 pool's entry point (what the layer chain calls) follows the choice."""
    monkeypatch.delenv(cpu_kernels.PRODUCTS_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "BusyProbe", QuietProbe)
    kernel = native_kernel()
    if not kernel.can_pair:
        assert not kernel.bf16_products and kernel.symbol(torch.bfloat16) == "paged_attention_short_bf16"
        return
    library = cpu_kernels.build("paged_attention")
    entries = cpu_kernels.read_json(cpu_kernels.products_record(library))
    if str(torch.get_num_threads()) not in entries:
        # this session's first measurement was taken on a busy host (or its passes disagreed)
        # and held for its process only: measure again, quiet, with one pass's times for both
        timings = cpu_kernels._products_timings(kernel)
        monkeypatch.setattr(cpu_kernels, "_products_timings", lambda k: timings)
        kernel = cpu_kernels._paged_attention_kernel(ctypes.CDLL(str(library)))
    assert cpu_kernels.products_record(library).exists()
    entry = json.loads(cpu_kernels.products_record(library).read_text())[str(torch.get_num_threads())]
    assert entry["threads"] == torch.get_num_threads() and entry["cpu"] == cpu_kernels.cpu_name()
    assert kernel.bf16_products == (entry["choice"] == "bf16") == \
        (entry["bf16_ms"] <= cpu_kernels.PAIRS_MARGIN * entry["fp32_ms"] + 1e-3)
    assert kernel.symbol(torch.bfloat16) == ("paged_attention_short_bf16_pairs" if kernel.bf16_products
                                             else "paged_attention_short_bf16")
    assert kernel.symbol(torch.float32) == "paged_attention_short"


def test_the_products_choice_is_measured_once_a_near_tie_keeps_fp32_and_the_variable_overrides(tmp_path, monkeypatch):
    kernel = kernel_build("bf16 products")
    monkeypatch.delenv(cpu_kernels.PRODUCTS_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "BusyProbe", QuietProbe)
    measured = []

    def timings(k, ratio):
        measured.append(k)
        return 1.0, ratio

    def record(name):
        return json.loads((tmp_path / f"paged_attention-{name}.products.json").read_text())

    first, second = tmp_path / "paged_attention-a.so", tmp_path / "paged_attention-b.so"
    monkeypatch.setattr(cpu_kernels, "_products_timings", lambda k: timings(k, 0.9))
    assert cpu_kernels.choose_bf16_products(kernel, first) and len(measured) == 2  # two passes
    threads = str(torch.get_num_threads())
    assert record("a")[threads]["choice"] == "bf16" and record("a")[threads]["threads"] == int(threads)
    monkeypatch.setattr(cpu_kernels, "_products_timings", lambda k: timings(k, 0.5 / cpu_kernels.PAIRS_MARGIN))
    assert cpu_kernels.choose_bf16_products(kernel, first) and len(measured) == 2  # the record, not a measurement
    monkeypatch.setattr(cpu_kernels, "_products_timings", lambda k: timings(k, 0.97))
    assert not cpu_kernels.choose_bf16_products(kernel, second) and len(measured) == 4
    monkeypatch.setenv(cpu_kernels.PRODUCTS_ENV, "bf16")
    assert cpu_kernels.choose_bf16_products(kernel, second)
    monkeypatch.setenv(cpu_kernels.PRODUCTS_ENV, "fp32")
    assert not cpu_kernels.choose_bf16_products(kernel, first) and len(measured) == 4
    monkeypatch.delenv(cpu_kernels.PRODUCTS_ENV)
    (tmp_path / "paged_attention-b.products.json").write_text("{\"bf")  # a torn record is measured again
    monkeypatch.setattr(cpu_kernels, "_products_timings", lambda k: timings(k, 0.5))
    assert cpu_kernels.choose_bf16_products(kernel, second) and len(measured) == 6
    assert record("b")[threads] | {"measured_at": 0} == {
        "choice": "bf16", "fp32_ms": 1000.0, "bf16_ms": 500.0, "threads": int(threads),
        "cpu": cpu_kernels.cpu_name(), "measured_at": 0, "others_busy": 0.0}
    assert cpu_kernels.choose_bf16_products(kernel, tmp_path / "missing" / "paged_attention-c.so")  # no record there
    assert len(measured) == 8 and not (tmp_path / "missing").exists()
    kernel.can_pair = False  # a build without them
    monkeypatch.setenv(cpu_kernels.PRODUCTS_ENV, "bf16")
    assert not cpu_kernels.choose_bf16_products(kernel, first)


def test_the_products_choice_is_recorded_only_when_the_host_was_quiet_and_both_passes_agree(tmp_path, monkeypatch):
    """Measured beside other work, or with passes that disagree (a burst of load in one), the
    choice holds for this process (disagreeing: the exact fp32 products) and is not recorded:
    the next process measures again. A record of another thread count is not this one's."""
    kernel = kernel_build("bf16 products")
    monkeypatch.delenv(cpu_kernels.PRODUCTS_ENV, raising=False)
    library = tmp_path / "paged_attention-a.so"
    path = cpu_kernels.products_record(library)
    busy = type("BusyHost", (QuietProbe,), {"share_value": 0.5})
    monkeypatch.setattr(cpu_kernels, "BusyProbe", busy)
    monkeypatch.setattr(cpu_kernels, "_products_timings", lambda k: (1.0, 0.5))
    assert cpu_kernels.choose_bf16_products(kernel, library) and not path.exists()
    monkeypatch.setattr(cpu_kernels, "BusyProbe", QuietProbe)
    ratios = iter([0.5, 1.5])
    monkeypatch.setattr(cpu_kernels, "_products_timings", lambda k: (1.0, next(ratios)))
    assert not cpu_kernels.choose_bf16_products(kernel, library) and not path.exists()
    path.write_text(json.dumps({str(torch.get_num_threads() + 1): {"choice": "bf16"}}))
    monkeypatch.setattr(cpu_kernels, "_products_timings", lambda k: (1.0, 1.5))
    assert not cpu_kernels.choose_bf16_products(kernel, library)
    assert set(json.loads(path.read_text())) == {str(torch.get_num_threads()), str(torch.get_num_threads() + 1)}


def attend_by(kernel, batch, kv, q):
    backend = TorchCpuBackend(batch.block_size)
    backend.kernel = kernel
    return backend.attend(kv, q, backend.prepare(batch))


@pytest.mark.parametrize("build", ["bf16 products", "fp32 products", "f16 pool"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (64, 8), (128, 32), (256, 16)])
def test_sequences_sharing_a_prompt_give_the_bits_each_gives_alone(head_dim, block_size, build):
    """A bf16 pool whose sequences share their first blocks: their rows are scored against each
    shared key tile together (up to 8 sequences a task). Each row's output equals the torch path's
    (within the bf16 products' rounding where the build takes them) and, to the last bit, what its
    sequence gives alone: decodes, verification chunks, a sequence shorter than the shared blocks,
    and more sharers than one task holds; head_dim 256 (Gemma 3) takes the loop's generic width."""
    kernel = kernel_build(build)
    assert kernel.bf16_products == (build == "bf16 products")
    lengths = [300, 310, 299, 420, 305, 333, 301, 302, 303, 40, 350, 300]
    rows = [1, 1, 4, 1, 1, 3, 1, 1, 1, 1, 2, 1]
    batch, kv, q = shared_prefix_step(300 // block_size, lengths, rows, block_size, 8, 2, head_dim)
    if build == "f16 pool":
        kv = kv.float().half()
    step = attend_by(kernel, batch, kv, q)
    torch.testing.assert_close(step, attend(batch, kv, q, use_kernel=False),
                               atol=atol(torch.bfloat16, head_dim, kernel=kernel), rtol=0)
    tokens, blocks = batch.token_offsets(), batch.block_offsets()
    for a in range(batch.num_seqs):
        alone = AttentionBatch(batch.start_positions[a:a + 1], batch.num_tokens[a:a + 1], batch.num_blocks[a:a + 1],
                               batch.block_ids[blocks[a]:blocks[a + 1]], block_size)
        assert torch.equal(attend_by(kernel, alone, kv, q[tokens[a]:tokens[a + 1]]), step[tokens[a]:tokens[a + 1]]), a


def rounded_attention(batch, kv, q):
    """Causal attention row by hand in float64 with the bf16 products' roundings: the query
    rounded to bf16 before the scores, the probabilities after the softmax."""
    kv_flat = kv.float().view(2, -1, kv.shape[-2], kv.shape[-1])
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // kv.shape[-2]
    for seq, (start, n) in enumerate(zip(batch.start_positions.tolist(), batch.num_tokens.tolist())):
        table = batch.padded_tables(np.array([seq]))[0]
        slots = (torch.from_numpy(table)[:, None] * batch.block_size + torch.arange(batch.block_size)).reshape(-1)
        k, v = (kv_flat[j, slots[:start + n]].repeat_interleave(group, dim=1).double() for j in (0, 1))
        for i in range(n):
            scores = torch.einsum("hd,khd->hk", q[row + i].bfloat16().double(), k) * q.shape[-1] ** -0.5
            scores[:, start + i + 1:] = float("-inf")
            probs = scores.softmax(-1).float().bfloat16().double()
            out[row + i] = torch.einsum("hk,khd->hd", probs, v).float()
        row += n
    return out


@pytest.mark.parametrize("head_dim,shared", [(64, False), (128, False), (64, True)])
def test_bf16_products_round_the_query_and_the_probabilities_and_nothing_else(head_dim, shared):
    """With AVX512-BF16 the bf16 pool's rows are attention with the query and the probabilities
    rounded to bf16 and every product exact: within float sums' last bits of that computed by
    hand (a rounding tie may move one probability by its last bit), ~100x closer than to the
    same attention unrounded. Decodes and verification chunks, shared blocks or not."""
    kernel = kernel_build("bf16 products")
    if shared:
        batch, kv, q = shared_prefix_step(300 // 16, [300, 310, 299, 420, 305, 40], [1, 1, 4, 1, 3, 1],
                                          16, 8, 2, head_dim)
    else:
        batch, kv, q = random_step([0, 5, 48, 37, 100, 2, 63], [1, 1, 1, 4, 16, 3, 1], 8, 2, head_dim, seed=2)
        kv = kv.bfloat16()
    got = attend_by(kernel, batch, kv, q)
    near = (got - rounded_attention(batch, kv, q)).abs().max().item()
    exact = (got - reference_attention(batch, kv.float(), q)).abs().max().item()
    assert near < 2e-4 and near * 20 < exact, (near, exact)


@HALF_DTYPES
def test_the_16_bit_loops_without_avx2_agree_with_the_torch_path(half):
    """The plain-C widening (CPUs without AVX2 or F16C): the compiler fuses another subset of its
    multiply-adds there, so its last bits may differ from this machine's; its values do not."""
    other = cpu_kernels.PagedAttentionKernel(ctypes.CDLL(str(cpu_kernels.build(
        "paged_attention", ("-mno-avx512f", "-mno-avx2", "-mno-f16c")))))
    batch, kv, q = random_step([0, 37, 100, 9], [1, 4, 1, 16], 8, 2, 24, seed=6)
    kv16 = kv.to(half)
    backend = TorchCpuBackend(batch.block_size)
    backend.kernel = other
    torch.testing.assert_close(backend.attend(kv16, q, backend.prepare(batch)),
                               attend(batch, kv16, q, use_kernel=False), atol=2e-6, rtol=0)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("build", ["bf16 products", "fp32 products", "f16 pool"])
def test_chunks_up_to_the_kernels_limit_take_the_kernel_over_a_16_bit_pool(build, invariant):
    """Over a bf16 or f16 pool the keys-in-lanes loop takes, chunks of 17..KERNEL_CHUNK_TOKENS tokens (a
    prompt's rest after a cached prefix, a budgeted prompt chunk) are the kernel's second padded
    batch (a lone sequence's in slices of 32 rows, each reading only the keys its rows see): each
    of their rows is, to the last bit, that token decoded alone at its position. Longer chunks keep
    SDPA, unless batch-invariant: then they are cut into pieces of KERNEL_CHUNK_TOKENS for the
    kernel, and their rows too are decoding's bits, however a prompt was chunked. Over an fp32
    pool the medium chunks take SDPA as long chunks (batch-invariant: the kernel, next test)."""
    kernel = kernel_build(build)
    if not kernel.lanes_loop(64):
        pytest.skip("this build has no keys-in-lanes loop (AVX-512)")
    from workers.model.attention import KERNEL_CHUNK_TOKENS, SHORT_CHUNK_TOKENS
    starts, rows = [300, 0, 40, 7, 0], [1, 40, 17, KERNEL_CHUNK_TOKENS, KERNEL_CHUNK_TOKENS + 2]
    batch, kv, q = random_step(starts, rows, 9, 3, 64, seed=8)
    backend = TorchCpuBackend(batch.block_size, batch_invariant=invariant)
    backend.kernel = kernel
    meta = backend.prepare(batch)
    pieces = [KERNEL_CHUNK_TOKENS, 2] if invariant else []
    assert meta.medium is not None and meta.medium.num_rows.tolist() == rows[1:4] + pieces
    assert [c.num_tokens for c in meta.longs] == ([] if invariant else [KERNEL_CHUNK_TOKENS + 2])
    kv16 = kv.half() if build == "f16 pool" else kv.bfloat16()
    got = backend.attend(kv16, q, meta)
    torch.testing.assert_close(got, attend(batch, kv16, q, use_kernel=False), atol=atol(kv16.dtype, 64, kernel=kernel),
                               rtol=0)
    tokens, blocks = batch.token_offsets(), batch.block_offsets()
    for a in (1, 2, 3, 4) if invariant else (1, 2, 3):
        table = batch.block_ids[blocks[a]:blocks[a + 1]]
        edges = {0, 31, 32, rows[a] // 2, KERNEL_CHUNK_TOKENS - 1, KERNEL_CHUNK_TOKENS, rows[a] - 1}
        for i in sorted(edges & set(range(rows[a]))):  # slices' and pieces' edges
            position = starts[a] + i
            need = position // batch.block_size + 1
            alone = AttentionBatch(np.array([position]), np.array([1]), np.array([need]), table[:need], batch.block_size)
            row = tokens[a] + i
            assert torch.equal(attend_by(kernel, alone, kv16, q[row:row + 1]), got[row:row + 1]), (a, i)
    assert rows[1] > SHORT_CHUNK_TOKENS
    torch.testing.assert_close(backend.attend(kv, q, meta), attend(batch, kv, q, use_kernel=False), atol=2e-6, rtol=0)


def test_batch_invariant_attends_every_chunk_over_an_fp32_pool_with_the_kernel():
    """`--batch-invariant` over an fp32 pool (no keys-in-lanes loop there): a prompt chunk of any
    length, cut into pieces, gives each row the bits of that token decoded alone."""
    from workers.model.attention import KERNEL_CHUNK_TOKENS
    starts, rows = [0, 20], [KERNEL_CHUNK_TOKENS + 40, 1]
    batch, kv, q = random_step(starts, rows, 8, 2, 64, seed=11)
    backend = TorchCpuBackend(batch.block_size, batch_invariant=True)
    if backend.kernel is None:
        pytest.skip("no C compiler: no kernel")
    meta = backend.prepare(batch)
    assert meta.longs == [] and meta.medium is not None
    got = backend.attend(kv, q, meta)
    torch.testing.assert_close(got, attend(batch, kv, q, use_kernel=False), atol=2e-6, rtol=0)
    table = batch.block_ids[:batch.num_blocks[0]]
    for i in (0, 17, KERNEL_CHUNK_TOKENS - 1, KERNEL_CHUNK_TOKENS, rows[0] - 1):
        need = i // batch.block_size + 1
        alone = AttentionBatch(np.array([i]), np.array([1]), np.array([need]), table[:need], batch.block_size)
        assert torch.equal(attend_by(backend.kernel, alone, kv, q[i:i + 1]), got[i:i + 1]), i
