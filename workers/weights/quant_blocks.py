"""GGUF weights as 4-bit codes in groups of 32 inputs (torch's int4 kernels), where that is exact.

Each group g of a row holds `w = d * code + m` (code 0..15): Q4_1 is exactly that, Q4_0 is
m = -8d, and Q4_K is that per 32-value sub-block with d = d * sc_j, m = -dmin * m_j. Q8_0's
signed 8-bit values q split into two 4-bit *planes*, laid side by side along the input
dimension: q = 16 * hi + lo with hi = q >> 4 in [-8, 7] and lo = q & 15, so plane 0 holds code
hi + 8 with (d, m) = (16d, -128d) and plane 1 holds lo with (d, 0). The 5-bit types (Q5_0,
Q5_1, Q5_K) split as q = lo + 16 * hbit: plane 0 the low nibble with the type's (d, m), plane 1
the fifth bit with (16d, 0). A matmul over [x | x] with the two-plane matrix is x @ W.T.
`dense()` equals gguf's dequantizers bit for bit, except that Q5_1 and Q5_K add their two
planes in fp32 (at most one ulp apart). Q6_K, Q3_K and Q2_K scale 16-value groups, which the
int4 kernels do not take: they stay GGUF blocks (block_matrix.py). Owns: these block layouts
and the plane split. Does not own: the kernels' layouts (quant_linear.py), tensor names and
shapes (gguf_loader.py).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Callable, Sequence, Union

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from justapi.model.gguf_file import GGUFError
from workers.weights.block_matrix import BlockMatrix, RowStack, block_matrix
from workers.weights.dequant import dequantize

Q = GGMLQuantizationType
GROUP_SIZE = 32
"""Inputs per (d, m) pair: the block size of Q4_0, Q4_1 and Q8_0, the sub-block of Q4_K and
Q5_K, and a group size torch's int4 kernels take."""
_PLANES = {Q.Q4_0: 1, Q.Q4_1: 1, Q.Q8_0: 2, Q.Q4_K: 1, Q.Q5_0: 2, Q.Q5_1: 2, Q.Q5_K: 2}
QUANTIZABLE_TYPES = tuple(_PLANES)


@dataclass(frozen=True)
class QuantMatrix:
    """A weight [out_features, in_features] as 4-bit codes, two codes a byte (low nibble first).

        codes columns: | plane 0: in_features codes | plane 1 (Q8_0 only) | -> w = sum of planes
        group g of a plane covers codes [32g, 32g + 32); d[:, g], m[:, g] are its pair

    `device` and `dtype` are where and in what rows come out of a lookup (`matrix[token_ids]`),
    which serves the token embedding without a dense copy."""

    packed: torch.Tensor  # uint8 [out, num_planes * in / 2]
    d: torch.Tensor  # fp32 [out, num_planes * in / 32]
    m: torch.Tensor  # fp32 [out, num_planes * in / 32]
    num_planes: int
    type_name: str  # the GGUF type it came from (Q4_0, Q4_1, Q8_0, Q4_K, Q5_0, Q5_1, Q5_K)
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2 // self.num_planes

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.d, self.m))

    def codes(self) -> torch.Tensor:
        """uint8 [out, num_planes * in], values 0..15."""
        out = self.packed.shape[0]
        return torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).reshape(out, -1)

    def dense(self) -> torch.Tensor:
        """fp32 [out, in], equal to gguf's dequantization of the source tensor."""
        return _dense_rows(self.codes(), self.d, self.m, self.num_planes)

    def __getitem__(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the dense matrix, e.g. token ids -> embeddings: [len(row_ids), in] in `dtype`."""
        if row_ids.dim() != 1:
            raise ValueError(f"QuantMatrix row lookup takes a 1-d index tensor, got shape "
                             f"{tuple(row_ids.shape)}")
        packed = self.packed[row_ids]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(len(row_ids), -1)
        return _dense_rows(codes, self.d[row_ids], self.m[row_ids], self.num_planes).to(self.dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantMatrix:
        """The matrix with `fn` (a reordering of rows, e.g. the rotary un-permutation) applied
        to the rows of codes and of the group pairs alike."""
        return replace(self, packed=fn(self.packed).contiguous(), d=fn(self.d).contiguous(),
                       m=fn(self.m).contiguous())

    def to(self, device: str | torch.device, dtype: torch.dtype) -> QuantMatrix:
        """Buffers on `device`; lookups produce `dtype`."""
        return replace(self, packed=self.packed.to(device), d=self.d.to(device),
                       m=self.m.to(device), dtype=dtype)


Matrix = Union[torch.Tensor, QuantMatrix, BlockMatrix, RowStack]
"""A weight matrix as the loader hands it over: dense, 4-bit planes, GGUF blocks, or a stack
of parts in different forms."""


def _dense_rows(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, num_planes: int) -> torch.Tensor:
    rows = codes.shape[0]
    groups = codes.view(rows, -1, GROUP_SIZE).float()  # [rows, planes * in / 32, 32]
    planes = (groups * d[:, :, None] + m[:, :, None]).reshape(rows, num_planes, -1)  # [rows, P, in]
    out = planes[:, 0]
    for plane in range(1, num_planes):
        out = out + planes[:, plane]
    return out


def is_quantizable(qtype: GGMLQuantizationType) -> bool:
    return qtype in _PLANES


FORMS = ("dense", "planes", "blocks")
"""How a loaded matrix is kept: dequantized, as 4-bit planes (QuantMatrix), as GGUF blocks."""
FormChooser = Callable[[GGMLQuantizationType], str]


def planes_where_exact(qtype: GGMLQuantizationType) -> str:
    """`keep_quantized=True`: 4-bit planes for the types that have them, the rest dense."""
    return "planes" if is_quantizable(qtype) else "dense"


def load_matrix(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str,
                form: str) -> Matrix:
    """GGUF tensor data -> the matrix in `form` (FORMS)."""
    if form == "planes":
        return quant_matrix(data, qtype, shape, name)
    if form == "blocks":
        return block_matrix(data, qtype, shape, name)
    if form != "dense":
        raise ValueError(f"matrix form must be one of {FORMS}, got {form!r}")
    return dequantize(data, qtype, shape, name)


def quant_matrix(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                 name: str = "tensor") -> QuantMatrix:
    """GGUF tensor data of a matrix of `shape` [out, in] of a QUANTIZABLE_TYPES type -> QuantMatrix."""
    if qtype not in _PLANES:
        raise GGUFError(f"{name}: type {qtype.name} has no 4-bit form (supported: "
                        f"{', '.join(t.name for t in QUANTIZABLE_TYPES)})")
    if len(shape) != 2 or shape[1] % GROUP_SIZE:
        raise GGUFError(f"{name}: shape {list(shape)} is not a matrix of {GROUP_SIZE}-value blocks")
    rows, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = _as_tensor(data.reshape(-1).view(np.uint8))
    if raw.numel() != rows * cols // block_size * type_size:
        raise GGUFError(f"{name}: data holds {raw.numel()} bytes, shape {list(shape)} of "
                        f"{qtype.name} needs {rows * cols // block_size * type_size} (corrupt file?)")
    blocks = raw.view(rows, cols // block_size, type_size)  # [out, in / block, bytes per block]
    if qtype == Q.Q8_0:
        return _q8_0(blocks)
    if qtype in (Q.Q4_0, Q.Q4_1):
        return _q4(blocks, has_min=qtype == Q.Q4_1, type_name=qtype.name)
    if qtype in (Q.Q5_0, Q.Q5_1):
        return _q5(blocks, has_min=qtype == Q.Q5_1)
    return _qk(blocks, has_high=qtype == Q.Q5_K)


def planes_of(matrix: BlockMatrix) -> QuantMatrix:
    """The 4-bit planes of a BlockMatrix of a QUANTIZABLE_TYPES type (same device and dtype)."""
    planes = quant_matrix(matrix.raw.numpy(), matrix.qtype, matrix.shape, matrix.type_name)
    return planes.to(matrix.device, matrix.dtype)


def _as_tensor(data: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memory map: we only read it
        return torch.from_numpy(np.ascontiguousarray(data))


def _fp16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes [start, start + 2) of every block as float16 -> fp32 [out, in / 32]."""
    return blocks[:, :, start:start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, n] (n even) -> [out, n / 2], code 2i in the low nibble of byte i."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _q4(blocks: torch.Tensor, has_min: bool, type_name: str) -> QuantMatrix:
    # Q4_0 block (18 bytes): d f16 | 16 bytes;  Q4_1 (20 bytes): d f16 | m f16 | 16 bytes.
    # Byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble).
    rows = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    m = _fp16_field(blocks, 2) if has_min else -8.0 * d  # Q4_0: d * (q - 8) = d * q - 8d
    nibbles = blocks[:, :, 4 if has_min else 2:]  # [out, in / 32, 16]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, -1)  # [out, in]
    return QuantMatrix(_pack(codes), d, m, 1, type_name)


def _q5(blocks: torch.Tensor, has_min: bool) -> QuantMatrix:
    # Q5_0 block (22 bytes): d f16 | qh u32 | 16 bytes;  Q5_1 (24): d | m | qh | 16 bytes.
    # Value j: low nibble as in Q4_x, fifth bit j of qh.  Q5_0: d * (q - 16);  Q5_1: d * q + m.
    rows = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    m = _fp16_field(blocks, 2) if has_min else -16.0 * d
    start = 4 if has_min else 2
    qh = blocks[:, :, start:start + 4].to(torch.int64)  # [out, in / 32, 4] little-endian bytes
    bits = (qh[:, :, torch.arange(32) // 8] >> (torch.arange(32) % 8)) & 1  # [out, in / 32, 32]
    nibbles = blocks[:, :, start + 4:]
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, -1)  # [out, in]
    codes = torch.cat([low, bits.to(torch.uint8).reshape(rows, -1)], dim=1)  # | low | fifth bit |
    return QuantMatrix(_pack(codes), torch.cat([d, 16.0 * d], dim=1),
                       torch.cat([m, torch.zeros_like(d)], dim=1), 2, "Q5_1" if has_min else "Q5_0")


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K packed 6-bit scales and mins [..., 12] -> ([..., 8], [..., 8]) as int64."""
    s = scales.to(torch.int64)
    low = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return low, mins


def _qk(blocks: torch.Tensor, has_high: bool) -> QuantMatrix:
    # Q4_K block (144 bytes): d | dmin | scales[12] | qs[128];  Q5_K (176): ... | qh[32] | qs.
    # Sub-block j of 32: nibble j % 2 of qs[32 (j / 2) + l], fifth bit j of qh[l];
    # value = d * sc_j * q - dmin * m_j.
    rows, num_blocks = blocks.shape[:2]
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)  # [out, in / 256]
    sc, mn = _k_scales(blocks[:, :, 4:16])  # [out, in / 256, 8]
    group_d = (d[:, :, None] * sc.float()).reshape(rows, -1)  # [out, in / 32]
    group_m = -(dmin[:, :, None] * mn.float()).reshape(rows, -1)
    qs = blocks[:, :, 48 if has_high else 16:].reshape(rows, num_blocks, 4, 1, 32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, -1)  # sub-blocks in order
    if not has_high:
        return QuantMatrix(_pack(low), group_d, group_m, 1, "Q4_K")
    qh = blocks[:, :, 16:48].reshape(rows, num_blocks, 1, 32)
    high = ((qh >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1).reshape(rows, -1)
    return QuantMatrix(_pack(torch.cat([low, high], dim=1)), torch.cat([group_d, 16.0 * group_d], dim=1),
                       torch.cat([group_m, torch.zeros_like(group_m)], dim=1), 2, "Q5_K")


def _q8_0(blocks: torch.Tensor) -> QuantMatrix:
    # Q8_0 block (34 bytes): d f16 | 32 x int8;  q = 16 * hi + lo, hi in [-8, 7], lo in [0, 15]
    rows = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    q = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(rows, -1).to(torch.int16)
    hi_codes = ((q >> 4) + 8).to(torch.uint8)  # [out, in], 0..15
    lo_codes = (q & 0x0F).to(torch.uint8)
    codes = torch.cat([hi_codes, lo_codes], dim=1)  # [out, 2 * in]: | plane hi | plane lo |
    return QuantMatrix(_pack(codes), torch.cat([16.0 * d, d], dim=1),
                       torch.cat([-128.0 * d, torch.zeros_like(d)], dim=1), 2, "Q8_0")


def cat_rows(parts: Sequence[Matrix]) -> Matrix:
    """Stack matrices along rows (Q/K/V or gate/up fusion): one matrix when every part has the
    same form (dense; 4-bit planes of one plane count; GGUF blocks of one type), else a
    RowStack whose parts keep their forms (Q4_K_M files give Q4_K and Q6_K rows)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))  # type: ignore[arg-type]
    quant = [p for p in parts if isinstance(p, QuantMatrix)]
    if len(quant) == len(parts) and len({p.num_planes for p in quant}) == 1:
        types = sorted({p.type_name for p in quant})
        return QuantMatrix(torch.cat([p.packed for p in quant]), torch.cat([p.d for p in quant]),
                           torch.cat([p.m for p in quant]), quant[0].num_planes, "+".join(types),
                           quant[0].dtype)
    blocks = [p for p in parts if isinstance(p, BlockMatrix)]
    if len(blocks) == len(parts) and len({p.qtype for p in blocks}) == 1:
        return replace(blocks[0], raw=torch.cat([p.raw for p in blocks]))
    return RowStack(tuple(parts))
