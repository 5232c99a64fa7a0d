"""Paged attention in place, in Triton: the K/V of every sequence are read from the block pool
where they lie (no gathered copy), for any mix of decodes, prefill chunks and speculative
verification chunks (token-tree masks) in one launch; plus the kernel that stores a step's
new K/V into their slots (skipping padding rows, slot -1).

One program computes one tile (paged_layout.py: block_q rows of a sequence) for one KV head:
its block_q x group query rows share every K/V load (GQA), and it walks the sequence's keys
BLOCK_N at a time with an online softmax (flash attention). Scale, sliding window and logit
soft-capping are parameters. The pool is fp32, bf16 or f16 (--kv-cache-dtype): the dots run in
the pool's type (fp32 queries: in fp32 over the widened values), accumulating in fp32. Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors in
Triton's interpreter (tests). Only GPU runners import this module (backends.py, lazily), and
it imports without Triton installed (the kernels then stay plain functions, never called).
Owns: the kernels and their launch. Does not own: the layout (paged_layout.py) or metadata.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Protocol, no_type_check

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without Triton: the kernels are never compiled
    triton = None  # type: ignore[assignment]


def _jit(fn: Any) -> Any:
    """triton.jit where Triton is installed (an interpreted kernel under TRITON_INTERPRET=1,
    read as the module is imported; tests/conftest.py sets it where no GPU is visible)."""
    return fn if triton is None else triton.jit(fn)


BLOCK_N = 32
"""Keys per inner-loop iteration (two 16-slot blocks): the tile width of both dots."""


class LayerAttention(Protocol):
    """How one layer attends, as the kernel reads it: AttentionParams below, or any object with
    these fields (a model's per-layer parameters, #18)."""

    @property
    def scale(self) -> float | None: ...  # of q . k; None: head_dim ** -0.5

    @property
    def window(self) -> int: ...  # >0: a query at position p sees keys in (p - window, p]

    @property
    def softcap(self) -> float: ...  # >0: scores become softcap * tanh(score / softcap)


@dataclass(frozen=True)
class AttentionParams:
    """Per-model attention constants (a LayerAttention; a layer with a window passes its own)."""

    scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    window: int = 0
    softcap: float = 0.0


@_jit
@no_type_check  # Triton's language, not Python's types
def _attention_kernel(q_ptr, kv_ptr, out_ptr, tables_ptr, first_rows_ptr, starts_ptr, num_rows_ptr,
                      num_keys_ptr, tile_seqs_ptr, tile_rows_ptr, tree_first_ptr, tree_base_ptr,
                      tree_rows_ptr, tree_span_ptr, tree_off_ptr, tree_bits_ptr, part_acc_ptr, part_ml_ptr,
                      scale, softcap, window,
                      stride_qt, stride_qh, stride_side, stride_block, stride_slot, stride_kvh,
                      stride_ot, stride_oh, stride_table,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, IS_FP32: tl.constexpr, NUM_SPLITS: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seqs_ptr + tile)
    row0 = tl.load(tile_rows_ptr + tile)
    first_row = tl.load(first_rows_ptr + seq)
    start = tl.load(starts_ptr + seq)
    num_rows = tl.load(num_rows_ptr + seq)
    num_keys = tl.load(num_keys_ptr + seq)
    m = tl.arange(0, BLOCK_M)  # query row of the tile: token m // GROUP, head m % GROUP
    q_index = row0 + m // GROUP  # row within the sequence's chunk
    head = kv_head * GROUP + m % GROUP
    row_ok = (m // GROUP < BLOCK_Q) & (q_index < num_rows)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (first_row + q_index).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = start + q_index  # slot positions (causality is by slot, tree rows included)
    hi = tl.minimum(start + tl.minimum(row0 + BLOCK_Q, num_rows), num_keys)  # past the last key seen
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(start + row0 - window + 1, 0) // BLOCK_N * BLOCK_N
    if NUM_SPLITS > 1:  # this program's share of the keys, whole key tiles each
        span = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * span
        hi = tl.minimum(lo + span, hi)
    if HAS_TREE:
        t_first = tl.load(tree_first_ptr + seq)
        t_base = tl.load(tree_base_ptr + seq)
        t_rows = tl.load(tree_rows_ptr + seq)
        t_span = tl.load(tree_span_ptr + seq)
        t_off = tl.load(tree_off_ptr + seq)
        t_row = q_index - t_first
        t_row_ok = (t_row >= 0) & (t_row < t_rows)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for k0 in range(lo, hi, BLOCK_N):
        k_pos = k0 + n
        k_ok = k_pos < hi
        block = tl.load(tables_ptr + seq * stride_table + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot = block.to(tl.int64) * stride_block + (k_pos % BLOCK_SIZE) * stride_slot + kv_head * stride_kvh
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(kv_ptr + stride_side + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IS_FP32:  # a 16-bit pool's values widened (exact)
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
        else:  # q in the pool's type: bf16 q over an f16 pool is rounded to f16 (11 bits, not 8)
            s = tl.dot(q.to(k.dtype), tl.trans(k)) * scale
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
        if HAS_TREE:
            t_col = k_pos - t_base
            in_tree = t_row_ok[:, None] & ((t_col >= 0) & (t_col < t_span))[None, :]
            bits = tl.load(tree_bits_ptr + t_off + t_row[:, None] * t_span + t_col[None, :],
                           mask=in_tree & row_ok[:, None] & k_ok[None, :], other=0)
            visible = tl.where(in_tree, bits != 0, visible) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if NUM_SPLITS > 1:  # the partial softmax state, for _combine_splits_kernel
        part = (split * tl.num_programs(0) + tile) * tl.num_programs(1) + kv_head
        tl.store(part_acc_ptr + part * BLOCK_M * BLOCK_D + m[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + m, m_i)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + m, l_i)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no key seen (padding): zeros
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@_jit
@no_type_check
def _combine_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, first_rows_ptr, num_rows_ptr, tile_seqs_ptr,
                           tile_rows_ptr, stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                           NUM_SPLITS: tl.constexpr):
    """One (tile, KV head): the splits' online-softmax states merged into the rows' outputs."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seqs_ptr + tile)
    row0 = tl.load(tile_rows_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_index = row0 + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m // GROUP < BLOCK_Q) & (q_index < tl.load(num_rows_ptr + seq))
    q_rows = (tl.load(first_rows_ptr + seq) + q_index).to(tl.int64)
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        part = (split * tl.num_programs(0) + tile) * tl.num_programs(1) + kv_head
        m_all = tl.maximum(m_all, tl.load(part_ml_ptr + part * 2 * BLOCK_M + m))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in range(NUM_SPLITS):
        part = (split * tl.num_programs(0) + tile) * tl.num_programs(1) + kv_head
        weight = tl.exp(tl.load(part_ml_ptr + part * 2 * BLOCK_M + m) - m_safe)  # 0 for a split with no key
        l_all += weight * tl.load(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + m)
        acc += weight[:, None] * tl.load(part_acc_ptr + part * BLOCK_M * BLOCK_D + m[:, None] * BLOCK_D + d[None, :])
    out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


@_jit
@no_type_check
def _store_kv_kernel(k_ptr, v_ptr, kv_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_side, stride_slot, stride_kvh, KV_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot  # the row's slot, as a block
    mask = (h[:, None] < KV_HEADS) & (d[None, :] < HEAD_DIM) & (slots >= 0)  # slot -1: padding
    src = h[:, None] * stride_kh + d[None, :]
    dst = slots * stride_slot + h[:, None] * stride_kvh + d[None, :]
    k = tl.load(k_ptr + row * stride_kt + src, mask=mask, other=0.0)
    v = tl.load(v_ptr + row * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    tl.store(kv_ptr + dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(kv_ptr + stride_side + dst, v.to(kv_ptr.dtype.element_ty), mask=mask)


def is_interpreted() -> bool:
    """The kernels run in Triton's CPU interpreter (they then take CPU tensors only)."""
    return type(_attention_kernel).__name__ == "InterpretedFunction"


def has_triton() -> bool:
    return triton is not None


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def store_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """kv: one layer [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads,
    head_dim] (any row stride); slots: int64 [T], -1 rows skipped."""
    _, num_blocks, block_size, kv_heads, head_dim = kv.shape
    assert kv.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1
    _store_kv_kernel[(k.shape[0],)](
        k, v, kv, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0), kv.stride(2), kv.stride(3), KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=_next_pow2(kv_heads), BLOCK_D=_next_pow2(max(head_dim, 16)))


def paged_attention(q: torch.Tensor, kv: torch.Tensor, meta: Any, params: LayerAttention,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], attending every row to its sequence's
    keys in the pool (kv: one layer). `meta`: device tensors named as PagedLayout's fields,
    plus block_q, block_m and num_tiles (paged_backend.PagedMetadata)."""
    _, num_blocks, block_size, kv_heads, head_dim = kv.shape
    assert kv.is_contiguous() and q.stride(-1) == 1
    group = q.shape[1] // kv_heads
    scale = head_dim ** -0.5 if params.scale is None else params.scale
    out = torch.empty_like(q) if out is None else out
    splits = key_splits(meta.num_tiles, kv_heads, q.device)
    block_d = _next_pow2(max(head_dim, 16))
    parts = splits * meta.num_tiles * kv_heads if splits > 1 else 1
    part_acc = torch.empty(parts * meta.block_m * block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(parts * 2 * meta.block_m, dtype=torch.float32, device=q.device)
    grid = (meta.num_tiles, kv_heads, splits)
    _attention_kernel[grid](
        q, kv, out, meta.tables, meta.first_rows, meta.starts, meta.num_rows, meta.num_keys,
        meta.tile_seqs, meta.tile_rows, meta.tree_first_rows, meta.tree_bases, meta.tree_rows,
        meta.tree_spans, meta.tree_offsets, meta.tree_bits, part_acc, part_ml,
        scale, params.softcap, params.window,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        out.stride(0), out.stride(1), meta.tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_next_pow2(max(head_dim, 16)),
        BLOCK_M=meta.block_m, BLOCK_Q=meta.block_q, BLOCK_N=max(BLOCK_N, block_size),
        BLOCK_SIZE=block_size, HAS_TREE=meta.has_tree, HAS_WINDOW=params.window > 0,
        HAS_SOFTCAP=params.softcap > 0, IS_FP32=q.dtype == torch.float32, NUM_SPLITS=splits)
    if splits > 1:
        _combine_splits_kernel[(meta.num_tiles, kv_heads)](
            out, part_acc, part_ml, meta.first_rows, meta.num_rows, meta.tile_seqs, meta.tile_rows,
            out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=meta.block_m, BLOCK_Q=meta.block_q, NUM_SPLITS=splits)
    return out


MAX_SPLITS = 16


def key_splits(num_tiles: int, kv_heads: int, device: torch.device) -> int:
    """Programs per (tile, KV head) over the keys (a power of two up to MAX_SPLITS): enough for
    ~2 programs per SM when the step has few tiles (decodes at small batches: one tile per
    sequence), else 1. It reads the step's shape only, so a graph replays it at any length."""
    if FORCED_SPLITS:
        return FORCED_SPLITS
    programs = num_tiles * kv_heads
    if device.type != "cuda" or programs == 0:
        return 1
    want = 2 * _sm_count(device) // programs
    return 1 if want < 2 else min(MAX_SPLITS, 1 << (want.bit_length() - 1))


FORCED_SPLITS = int(os.environ.get("JUSTAPI_ATTENTION_SPLITS", "0"))
"""Every launch split so (tests: the interpreter has no SMs to count; 1 turns splitting off)."""


@functools.cache
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
