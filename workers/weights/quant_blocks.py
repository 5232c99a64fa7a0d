"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept quantized: 4-bit codes in groups of 32 inputs.

Each group g of a row holds `w = d * code + m` (code 0..15): Q4_1 is exactly that, Q4_0 is
m = -8d. Q8_0's signed 8-bit values q split into two 4-bit *planes*, laid side by side along
the input dimension: q = 16 * hi + lo with hi = q >> 4 in [-8, 7] and lo = q & 15, so plane 0
holds code hi + 8 with (d, m) = (16d, -128d) and plane 1 holds lo with (d, 0). A matmul over
[x | x] with the two-plane matrix is x @ W.T. `dense()` is bit-identical to gguf's dequantizers
(every product and sum here is exact in fp32). Owns: these block layouts and the plane split.
Does not own: the kernels' layouts (quant_linear.py), tensor names and shapes (gguf_loader.py).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Callable, Sequence, Union

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from justapi.model.gguf_file import GGUFError

Q = GGMLQuantizationType
GROUP_SIZE = 32
"""Inputs per (d, m) pair: the block size of Q4_0, Q4_1 and Q8_0 and a group size torch's int4
kernels take."""
QUANTIZABLE_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
_PLANES = {Q.Q4_0: 1, Q.Q4_1: 1, Q.Q8_0: 2}


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
    type_name: str  # the GGUF type it came from (Q4_0, Q4_1, Q8_0)
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


Matrix = Union[torch.Tensor, QuantMatrix]
"""A weight matrix as the loader hands it over: dense, or kept quantized."""


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


def quant_matrix(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                 name: str = "tensor") -> QuantMatrix:
    """GGUF tensor data of a Q4_0 / Q4_1 / Q8_0 matrix of `shape` [out, in] -> QuantMatrix."""
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
    blocks = raw.view(rows, cols // block_size, type_size)  # [out, in / 32, bytes per block]
    if qtype == Q.Q8_0:
        return _q8_0(blocks)
    return _q4(blocks, has_min=qtype == Q.Q4_1, type_name=qtype.name)


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
    """Stack matrices along rows (Q/K/V or gate/up fusion). Quantized parts stay quantized when
    all of them have the same number of planes; otherwise every part is made dense."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))  # type: ignore[arg-type]
    quant = [p for p in parts if isinstance(p, QuantMatrix)]
    if len(quant) == len(parts) and len({p.num_planes for p in quant}) == 1:
        types = sorted({p.type_name for p in quant})
        return QuantMatrix(torch.cat([p.packed for p in quant]), torch.cat([p.d for p in quant]),
                           torch.cat([p.m for p in quant]), quant[0].num_planes, "+".join(types),
                           quant[0].dtype)
    return torch.cat([p.dense() if isinstance(p, QuantMatrix) else p for p in parts])
