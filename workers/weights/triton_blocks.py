"""GGUF blocks read in place on the GPU, in Triton: a matmul that decodes the weights' blocks in
its inner loop (small steps: decode batches, verification), and the expansion of rows into a
dense tile or lookup (large steps' tiles, token embeddings).

Every kernel decodes the same tile: a [rows, G, 32] block of weights, G groups of 32 values
along the input dimension (a Q4_0/Q4_1/Q8_0 block, or a 32-value sub-block of a K-quant
super-block), each value in fp32 exactly as ggml's dequantizers compute it:

    Q4_0  d * (q - 8)          Q4_K  d * sc_s * q - dmin * m_s   (6-bit sc, m per sub-block)
    Q4_1  d * q + m            Q5_K  the same with a fifth bit from qh
    Q8_0  d * q (int8)         Q6_K  d * sc * (q - 32)            (int8 sc per 16 values)
    IQ4_NL d * T[q]            IQ4_XS (d * (ls_s - 32)) * T[q]    (6-bit ls per sub-block)

(T: the 16 signed levels of ggml's kvalues_iq4nl, selected from the nibble's bits.)

The fp16 fields are read through a float16 view of the same bytes (every one lies at an even
offset: all block sizes are even), int8 fields through an int8 view. Under TRITON_INTERPRET=1
the kernels run on CPU tensors (tests), as triton_attention.py's do.
Owns: the kernels and their launch. Does not own: which path a step takes (device_linear.py).
"""
from __future__ import annotations

import os
from typing import no_type_check

import torch
from gguf import GGMLQuantizationType

from workers.model.triton_attention import _jit, _next_pow2, _sm_count

try:
    import triton.language as tl
except ImportError:  # never launched without Triton
    tl = None  # type: ignore[assignment]

Q = GGMLQuantizationType
DEVICE_BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
"""Types these kernels decode."""
_TYPE_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210, Q.IQ4_NL: 18,
               Q.IQ4_XS: 136}
_SUPER_BLOCK_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
"""Types of 256-value blocks (the rest: 32)."""


@_jit
@no_type_check
def _iq4_level(q):
    """Nibbles -> fp32 levels of ggml's kvalues_iq4nl (-127 -104 -83 -65 -49 -35 -22 -10 1 13 25
    38 53 69 89 113), a tree of selects on the nibble's bits (no table in memory)."""
    b0, b1, b2 = (q & 1) != 0, (q & 2) != 0, (q & 4) != 0
    low = tl.where(b2, tl.where(b1, tl.where(b0, -10, -22), tl.where(b0, -35, -49)),
                   tl.where(b1, tl.where(b0, -65, -83), tl.where(b0, -104, -127)))
    high = tl.where(b2, tl.where(b1, tl.where(b0, 113, 89), tl.where(b0, 69, 53)),
                    tl.where(b1, tl.where(b0, 38, 25), tl.where(b0, 13, 1)))
    return tl.where(q >= 8, high, low).to(tl.float32)
MATMUL_BLOCK_N = 32
"""Output features per program of the in-place matmul."""
MAX_SPLITS = 16
FORCED_SPLITS = int(os.environ.get("JUSTAPI_BLOCK_SPLITS", "0"))
"""Split the input dimension so on every matmul launch (tests; 1 turns splitting off)."""


@_jit
@no_type_check
def _groups(raw_ptr, half_ptr, i8_ptr, row, gk, QTYPE: tl.constexpr):
    """Weights of groups `gk` [1, G, 1] of rows starting at byte `row` [R, 1, 1] -> fp32 [R, G, 32]."""
    lane = tl.arange(0, 32)[None, None, :]
    if QTYPE == 2:  # Q4_0: d | 16 bytes, value j: nibble (j // 16) of byte j % 16
        blk = row + gk * 18
        d = tl.load(half_ptr + blk // 2).to(tl.float32)
        q = (tl.load(raw_ptr + blk + 2 + lane % 16) >> (lane // 16 * 4)) & 15
        w = (q.to(tl.float32) - 8.0) * d
    elif QTYPE == 3:  # Q4_1: d | m | 16 bytes
        blk = row + gk * 20
        d = tl.load(half_ptr + blk // 2).to(tl.float32)
        m = tl.load(half_ptr + blk // 2 + 1).to(tl.float32)
        q = (tl.load(raw_ptr + blk + 4 + lane % 16) >> (lane // 16 * 4)) & 15
        w = d * q.to(tl.float32) + m
    elif QTYPE == 8:  # Q8_0: d | 32 int8
        blk = row + gk * 34
        d = tl.load(half_ptr + blk // 2).to(tl.float32)
        w = d * tl.load(i8_ptr + blk + 2 + lane).to(tl.float32)
    elif QTYPE == 20:  # IQ4_NL: d | 16 bytes, Q4_0's layout, value j: T[nibble (j // 16) of byte j % 16]
        blk = row + gk * 18
        d = tl.load(half_ptr + blk // 2).to(tl.float32)
        q = (tl.load(raw_ptr + blk + 2 + lane % 16) >> (lane // 16 * 4)) & 15
        w = d * _iq4_level(q)
    elif QTYPE == 23:  # IQ4_XS: d | scales_h u16 | scales_l[4] | qs[128], sub-block s: qs[16 s..] as IQ4_NL's
        blk = row + gk // 8 * 136
        s = gk % 8
        d = tl.load(half_ptr + blk // 2).to(tl.float32)
        high = tl.load(raw_ptr + blk + 2 + s // 4).to(tl.int32)  # bits 2s..2s+1 of scales_h: byte s // 4
        low = tl.load(raw_ptr + blk + 4 + s // 2).to(tl.int32)
        ls = ((low >> (s % 2 * 4)) & 15) | (((high >> (s % 4 * 2)) & 3) << 4)
        q = (tl.load(raw_ptr + blk + 8 + 16 * s + lane % 16) >> (lane // 16 * 4)) & 15
        w = (d * (ls - 32).to(tl.float32)) * _iq4_level(q)
    elif QTYPE == 14:  # Q6_K: ql[128] | qh[64] | int8 scales[16] | d, sub-block s of 32 values
        blk = row + gk // 8 * 210
        s = gk % 8
        h = s // 4  # which 128-value half
        t = s % 4  # which quarter of it
        low = (tl.load(raw_ptr + blk + 64 * h + 32 * (t % 2) + lane) >> (t // 2 * 4)) & 15
        high = (tl.load(raw_ptr + blk + 128 + 32 * h + lane) >> (2 * t)) & 3
        q = (low | (high << 4)).to(tl.int32) - 32
        sc = tl.load(i8_ptr + blk + 192 + 8 * h + 2 * t + lane // 16).to(tl.float32)
        d = tl.load(half_ptr + (blk + 208) // 2).to(tl.float32)
        w = (d * sc) * q.to(tl.float32)
    else:  # Q4_K, Q5_K: d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128]
        size = 144 if QTYPE == 12 else 176
        blk = row + gk // 8 * size
        s = gk % 8
        d = tl.load(half_ptr + blk // 2).to(tl.float32)
        dmin = tl.load(half_ptr + blk // 2 + 1).to(tl.float32)
        lo4 = tl.load(raw_ptr + blk + 4 + s % 4)  # scales[s % 4]
        mid = tl.load(raw_ptr + blk + 8 + s % 4)  # scales[4 + s % 4]
        hi = tl.load(raw_ptr + blk + 12 + s % 4)  # scales[8 + s % 4]
        sc = tl.where(s < 4, lo4 & 63, (hi & 15) | ((lo4 >> 6) << 4)).to(tl.float32)
        mn = tl.where(s < 4, mid & 63, (hi >> 4) | ((mid >> 6) << 4)).to(tl.float32)
        qs = 16 if QTYPE == 12 else 48
        q = ((tl.load(raw_ptr + blk + qs + 32 * (s // 2) + lane) >> (s % 2 * 4)) & 15).to(tl.int32)
        if QTYPE == 13:
            q += ((tl.load(raw_ptr + blk + 16 + lane) >> s) & 1).to(tl.int32) << 4
        w = (d * sc) * q.to(tl.float32) - dmin * mn
    return w


@_jit
@no_type_check
def _matmul_kernel(x_ptr, raw_ptr, half_ptr, i8_ptr, out_ptr, num_m, num_n, num_chunks,
                   stride_xm, stride_raw, stride_om, stride_split,
                   QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   G: tl.constexpr, SPLITS: tl.constexpr, IS_FP32: tl.constexpr):
    """out[split][m, n] = sum over this split's chunks of x[m, k] * W[n, k]; a chunk is G groups."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < num_n
    row = (tl.where(n_ok, n, 0).to(tl.int64) * stride_raw)[:, None, None]  # rows past N read row 0
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < num_m
    g = tl.arange(0, G)[None, :, None]
    kk = tl.arange(0, G * 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for chunk in range(split, num_chunks, SPLITS):
        w = tl.reshape(_groups(raw_ptr, half_ptr, i8_ptr, row, chunk * G + g, QTYPE), (BLOCK_N, G * 32))
        k = chunk * G * 32 + kk
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        if IS_FP32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = out_ptr + split * stride_split + m[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@_jit
@no_type_check
def _expand_kernel(raw_ptr, half_ptr, i8_ptr, ids_ptr, out_ptr, num_rows, first_row, stride_raw,
                   stride_out, QTYPE: tl.constexpr, HAS_IDS: tl.constexpr, BLOCK_R: tl.constexpr,
                   G: tl.constexpr):
    """out[r, chunk's values] = W[ids[r] (or first_row + r), chunk's values]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    if HAS_IDS:
        src = tl.load(ids_ptr + r, mask=r_ok, other=0)
    else:
        src = tl.where(r_ok, first_row + r, first_row)
    row = (src.to(tl.int64) * stride_raw)[:, None, None]
    chunk = tl.program_id(1)
    g = tl.arange(0, G)[None, :, None]
    w = tl.reshape(_groups(raw_ptr, half_ptr, i8_ptr, row, chunk * G + g, QTYPE), (BLOCK_R, G * 32))
    k = chunk * G * 32 + tl.arange(0, G * 32)
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_out + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None])


def groups_per_chunk(in_features: int, most: int = 8) -> int:
    """Groups of 32 values a kernel decodes per step along the input: the largest power of two
    up to `most` whose chunk divides the row (no ragged last chunk to mask)."""
    if in_features % 32:
        raise ValueError(f"rows of {in_features} values are not whole 32-value groups")
    groups = most
    while (in_features // 32) % groups:
        groups //= 2
    return groups


def _views(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes as float16 and int8 (one flat buffer: the kernels index bytes)."""
    flat = raw.reshape(-1)
    return flat.view(torch.float16), flat.view(torch.int8)


def _check(raw: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> None:
    if qtype not in DEVICE_BLOCK_TYPES:
        raise ValueError(f"no device kernel reads {qtype.name} blocks "
                         f"(they read {', '.join(t.name for t in DEVICE_BLOCK_TYPES)})")
    block = 256 if qtype in _SUPER_BLOCK_TYPES else 32
    if raw.dtype != torch.uint8 or not raw.is_contiguous() or in_features % block \
            or raw.shape[1] != in_features // block * _TYPE_BYTES[qtype]:
        raise ValueError(f"{qtype.name} blocks of shape {tuple(raw.shape)} do not hold rows of "
                         f"{in_features} values")


def expand_rows(raw: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                out: torch.Tensor, row_ids: torch.Tensor | None = None, first_row: int = 0) -> torch.Tensor:
    """Rows `row_ids` (int [R]) of the matrix, or rows first_row .. first_row + len(out), into
    `out` [R, in_features] (any float dtype, rows contiguous)."""
    _check(raw, qtype, in_features)
    num_rows = out.shape[0]
    if num_rows == 0:
        return out
    groups = groups_per_chunk(in_features)
    half, i8 = _views(raw)
    block_r = 16
    ids = row_ids if row_ids is not None else out  # unused without ids
    grid = (-(-num_rows // block_r), in_features // (32 * groups))
    _expand_kernel[grid](raw, half, i8, ids, out, num_rows, first_row, raw.stride(0), out.stride(0),
                         QTYPE=int(qtype), HAS_IDS=row_ids is not None, BLOCK_R=block_r, G=groups)
    return out


def block_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType,
                 in_features: int) -> torch.Tensor:
    """x [M, in] @ W.T -> [M, out] in x's dtype, the weights decoded in the kernel. Where the
    output tiles are too few to fill the device, the input dimension is split over programs
    and their partial sums added in a fixed order (no atomics: the same bits every time)."""
    _check(raw, qtype, in_features)
    if x.dim() != 2 or x.shape[1] != in_features or x.stride(1) != 1:
        raise ValueError(f"block matmul takes x [rows, {in_features}] with contiguous rows, "
                         f"got shape {tuple(x.shape)}")
    num_m, num_n = x.shape[0], raw.shape[0]
    groups = groups_per_chunk(in_features)
    num_chunks = in_features // (32 * groups)
    block_m = min(64, max(16, _next_pow2(num_m)))
    tiles = (-(-num_n // MATMUL_BLOCK_N), -(-num_m // block_m))
    splits = split_count(tiles[0] * tiles[1], num_chunks, x.device)
    if splits > 1:
        parts = torch.empty(splits, num_m, num_n, dtype=torch.float32, device=x.device)
        out, stride_split = parts, parts.stride(0)
    else:
        out = torch.empty(num_m, num_n, dtype=x.dtype, device=x.device)
        stride_split = 0
    if num_m:
        half, i8 = _views(raw)
        _matmul_kernel[(*tiles, splits)](
            x, raw, half, i8, out, num_m, num_n, num_chunks, x.stride(0), raw.stride(0),
            out.stride(-2), stride_split, QTYPE=int(qtype), BLOCK_M=block_m, BLOCK_N=MATMUL_BLOCK_N,
            G=groups, SPLITS=splits, IS_FP32=x.dtype == torch.float32)
    return out.sum(0).to(x.dtype) if splits > 1 else out


def split_count(num_tiles: int, num_chunks: int, device: torch.device) -> int:
    """Programs per output tile along the input dimension: a power of two making ~2 programs
    per SM where the tiles are fewer (decode of a narrow matrix), never more than its chunks."""
    if FORCED_SPLITS:
        return max(1, min(FORCED_SPLITS, num_chunks))
    if device.type != "cuda" or num_tiles == 0:
        return 1
    want = 2 * _sm_count(device) // num_tiles
    if want < 2:
        return 1
    return max(1, min(MAX_SPLITS, 1 << (want.bit_length() - 1), 1 << (num_chunks.bit_length() - 1)))
