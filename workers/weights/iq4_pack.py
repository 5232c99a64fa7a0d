"""Quantizers for IQ4_NL and IQ4_XS, which gguf-py can only read: float rows -> blocks in
llama.cpp's byte layout (decoded back by `gguf.quants.dequantize`), for tests and for the
benchmark's files (tools/bench/requant.py).

Both map each value to the nearest of 16 fixed non-uniform levels (IQ4_VALUES) times a scale
per 32 values: IQ4_NL keeps that scale as a float16, IQ4_XS as a 6-bit multiple of one float16
per 256 values. The scale is searched as llama.cpp's quantizer does without an importance
matrix (15 candidates around max|x| / 127, each refit by least squares weighted by x^2), so
a file made here is close to llama-quantize's of the same type. Owns: these quantizers.
Does not own: reading (gguf-py, workers/model/csrc/gguf_blocks.h).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
_MIDPOINTS = (IQ4_VALUES[1:] + IQ4_VALUES[:-1]) / 2
_TRIES = 7  # candidate inverse scales (t + IQ4_VALUES[0]) / max for t in [-7, 7], as llama.cpp


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes [n, 2], the float16 values back as fp32 [n])."""
    h = np.asarray(x, np.float32).astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32)


def nearest_codes(scaled: np.ndarray) -> np.ndarray:
    """Values already divided by their scale -> the index (0..15) of the nearest level."""
    return np.searchsorted(_MIDPOINTS, scaled).astype(np.uint8)


def group_scales(groups: np.ndarray) -> np.ndarray:
    """fp32 [n, 32] -> the best scale per group [n] (0 for an all-zero group)."""
    peak = np.take_along_axis(groups, np.abs(groups).argmax(-1)[:, None], -1)[:, 0]  # signed
    safe = np.where(peak == 0, 1.0, peak)
    weight = groups * groups
    best_d, best_score = np.zeros(len(groups), np.float32), np.full(len(groups), -np.inf)
    for t in range(-_TRIES, _TRIES + 1):
        inv = (t + IQ4_VALUES[0]) / safe
        q = IQ4_VALUES[nearest_codes(groups * inv[:, None])]
        sum_qx, sum_q2 = (weight * q * groups).sum(-1), (weight * q * q).sum(-1)
        d = np.where(sum_q2 > 0, sum_qx / np.where(sum_q2 > 0, sum_q2, 1), 0)
        score = d * sum_qx
        better = score > best_score
        best_d, best_score = np.where(better, d, best_d), np.where(better, score, best_score)
    return np.where(peak == 0, 0, best_d).astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[n, 32] codes -> [n, 16] bytes: byte j holds code j (low nibble) and code j + 16 (high)."""
    return codes[:, :16] | (codes[:, 16:] << 4)


def _codes(groups: np.ndarray, d: np.ndarray) -> np.ndarray:
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))
    return nearest_codes(groups * inv[:, None])


def pack_iq4_nl(x: np.ndarray) -> np.ndarray:
    """Float rows [rows, cols] (cols a multiple of 32) -> IQ4_NL blocks: d f16 | qs[16]."""
    rows = x.shape[0]
    groups = x.reshape(-1, 32).astype(np.float32)
    db, d = _f16(group_scales(groups))
    return np.concatenate([db, _pack_nibbles(_codes(groups, d))], 1).reshape(rows, -1)


def pack_iq4_xs(x: np.ndarray) -> np.ndarray:
    """Float rows [rows, cols] (cols a multiple of 256) -> IQ4_XS blocks:
    d f16 | scales_h u16 | scales_l[4] | qs[128], sub-block j's scale d * (ls_j - 32)."""
    rows = x.shape[0]
    groups = x.reshape(-1, 32).astype(np.float32)
    scales = group_scales(groups).reshape(-1, 8)  # [blocks, 8]
    peak = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)[:, 0]
    db, d = _f16(-peak / 32)
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))
    ls = (np.clip(np.rint(scales * inv[:, None]), -32, 31) + 32).astype(np.uint16)  # [blocks, 8], 0..63
    sub_d = (d[:, None] * (ls.astype(np.float32) - 32)).reshape(-1)
    qs = _pack_nibbles(_codes(groups, sub_d)).reshape(-1, 128)
    low = (ls & 15).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)  # [blocks, 4]
    scales_h = np.zeros(len(ls), np.uint16)
    for j in range(8):
        scales_h |= (ls[:, j] >> 4) << (2 * j)
    return np.concatenate([db, scales_h.reshape(-1, 1).view(np.uint8), scales_l, qs], 1).reshape(rows, -1)


def pack_iq4(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Float rows -> blocks of `qtype` (IQ4_NL or IQ4_XS)."""
    if qtype == GGMLQuantizationType.IQ4_NL:
        return pack_iq4_nl(x)
    if qtype == GGMLQuantizationType.IQ4_XS:
        return pack_iq4_xs(x)
    raise ValueError(f"iq4_pack quantizes IQ4_NL and IQ4_XS, not {qtype.name}")
