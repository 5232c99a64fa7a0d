"""Quantizers for the GGUF types gguf-py can only read (Q2_K..Q6_K; IQ4_NL and IQ4_XS from
iq4_pack.py): float rows -> blocks in
llama.cpp's byte layout (decoded back by `gguf.quants.dequantize`), for tests and for the
benchmark's files of each weight type (tools/bench/requant.py).

Simple min/max scales, not llama.cpp's search (round-trip relative RMS error on N(0, 1) rows:
Q2_K 0.33, Q3_K 0.16, Q4_K 0.08, Q5_K 0.04, Q6_K 0.02): the codes, scales and minimums cover
their whole ranges, which is what kernel tests need; a file made with them is a little less
accurate than llama.cpp's of the same type. `quantize(x, type)` also takes the types gguf-py
quantizes itself (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Owns: these quantizers. Does not own: reading.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from workers.weights.iq4_pack import pack_iq4_nl, pack_iq4_xs

Q = GGMLQuantizationType


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes [n, 2], the float16 values back as fp32 [n])."""
    h = np.asarray(x, np.float32).astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(blocks, 8) 6-bit scales and mins -> (blocks, 12) as Q4_K / Q5_K store them."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _affine_k(x: np.ndarray, nmax: int):
    xs = x.reshape(-1, 8, 32)
    lo, hi = np.minimum(xs.min(-1), 0), xs.max(-1)
    scale, mins = (hi - lo) / nmax, -lo
    db, d = _f16(scale.max(-1) / 63)
    mb, dmin = _f16(mins.max(-1) / 63)
    sc = np.clip(np.rint(_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_div(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    big_s, big_m = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.rint(_div(xs + big_m[..., None], big_s[..., None])), 0, nmax).astype(np.uint8)
    return q, db, mb, sc, mn


def pack_q4_k(x: np.ndarray) -> np.ndarray:
    rows = x.shape[0]
    x = x.reshape(-1, 256).astype(np.float32)
    q, db, mb, sc, mn = _affine_k(x, 15)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([db, mb, _pack_scales_k4(sc, mn), qs], 1).reshape(rows, -1)


def pack_q5_k(x: np.ndarray) -> np.ndarray:
    rows = x.shape[0]
    x = x.reshape(-1, 256).astype(np.float32)
    q, db, mb, sc, mn = _affine_k(x, 31)
    low, high = (q & 15).reshape(-1, 4, 2, 32), q >> 4
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= (high[:, j, :] << j).astype(np.uint8)
    return np.concatenate([db, mb, _pack_scales_k4(sc, mn), qh, qs], 1).reshape(rows, -1)


def pack_q6_k(x: np.ndarray) -> np.ndarray:
    rows = x.shape[0]
    x = x.reshape(-1, 256).astype(np.float32)
    xs = x.reshape(-1, 16, 16)
    peak = np.take_along_axis(xs, np.abs(xs).argmax(-1)[..., None], -1)[..., 0]
    scale = peak / -32
    db, d = _f16(np.abs(scale).max(-1) / 127)
    sc = np.clip(np.rint(_div(scale, d[:, None])), -128, 127).astype(np.int8)
    big_s = d[:, None] * sc
    q = (np.clip(np.rint(_div(xs, big_s[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.stack([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                   (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], 2).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh.astype(np.uint8), sc.view(np.uint8), db], 1).reshape(rows, -1)


def pack_q3_k(x: np.ndarray) -> np.ndarray:
    rows = x.shape[0]
    x = x.reshape(-1, 256).astype(np.float32)
    xs = x.reshape(-1, 16, 16)
    peak = np.take_along_axis(xs, np.abs(xs).argmax(-1)[..., None], -1)[..., 0]
    scale = peak / -4
    db, d = _f16(np.abs(scale).max(-1) / 31)
    sc = np.clip(np.rint(_div(scale, d[:, None])), -32, 31).astype(np.int32)
    big_s = d[:, None] * sc
    u = (np.clip(np.rint(_div(xs, big_s[..., None])), -4, 3) + 4).astype(np.uint8).reshape(-1, 256)
    low2, hbit = (u & 3).reshape(-1, 2, 4, 32), (u >> 2).reshape(-1, 8, 32)
    qs = (low2[:, :, 0] | (low2[:, :, 1] << 2) | (low2[:, :, 2] << 4) | (low2[:, :, 3] << 6)).reshape(-1, 64)
    hmask = np.zeros((x.shape[0], 32), np.uint8)
    for b in range(8):
        hmask |= (hbit[:, b, :] << b).astype(np.uint8)
    s6 = (sc + 32).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), np.uint8)
    for i in range(16):
        scales[:, i % 8] |= (s6[:, i] & 15) << (4 * (i // 8))
        scales[:, 8 + i % 4] |= (s6[:, i] >> 4) << (2 * (i // 4))
    return np.concatenate([hmask, qs, scales, db], 1).reshape(rows, -1)


def pack_q2_k(x: np.ndarray) -> np.ndarray:
    rows = x.shape[0]
    x = x.reshape(-1, 256).astype(np.float32)
    xs = x.reshape(-1, 16, 16)
    lo, hi = np.minimum(xs.min(-1), 0), xs.max(-1)
    scale, mins = (hi - lo) / 3, -lo
    db, d = _f16(scale.max(-1) / 15)
    mb, dmin = _f16(mins.max(-1) / 15)
    sc = np.clip(np.rint(_div(scale, d[:, None])), 0, 15).astype(np.uint8)
    mn = np.clip(np.rint(_div(mins, dmin[:, None])), 0, 15).astype(np.uint8)
    big_s, big_m = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.rint(_div(xs + big_m[..., None], big_s[..., None])), 0, 3).astype(np.uint8).reshape(-1, 2, 4, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([sc | (mn << 4), qs, db, mb], 1).reshape(rows, -1)


PACKERS = {Q.Q2_K: pack_q2_k, Q.Q3_K: pack_q3_k, Q.Q4_K: pack_q4_k, Q.Q5_K: pack_q5_k, Q.Q6_K: pack_q6_k,
           Q.IQ4_NL: pack_iq4_nl, Q.IQ4_XS: pack_iq4_xs}


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Float rows [rows, cols] -> uint8 blocks [rows, bytes per row] of `qtype`."""
    if qtype in PACKERS:
        return PACKERS[qtype](x)
    return gguf_quants.quantize(x.astype(np.float32), qtype)


def dequantize(blocks: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
    """gguf's own decoder: the reference."""
    return np.asarray(gguf_quants.dequantize(blocks, qtype), np.float32).reshape(shape)
