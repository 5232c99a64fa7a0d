"""GGUF weight matrices kept as the file's own blocks, and stacks of matrices of several types.

A BlockMatrix holds a quantized tensor's bytes unchanged, one row of blocks per output feature
(every row is whole blocks: GGUF quantizes along the input dimension), so its memory is the
file's. The CPU kernels of workers/model/csrc/quant_matmul.c (block_kernels.py) multiply and
expand it; row lookups (the token embedding) expand only the rows asked for. A RowStack is
a fused matrix (QKV, gate/up) whose parts have different types, as Q4_K_M files mix Q4_K and
Q6_K rows: each part keeps its form. Owns: keeping the bytes, lookups, row permutations.
Does not own: block layouts (csrc/gguf_blocks.h), kernels, or which path multiplies them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from justapi.model.gguf_file import GGUFError
from justapi.model.weight_types import BLOCK_TYPE_NAMES
from workers.weights.block_kernels import PACK_ROWS, PACKABLE, PACKED, BlockKernels

Q = GGMLQuantizationType
BLOCK_TYPES = tuple(GGMLQuantizationType[name] for name in BLOCK_TYPE_NAMES)
"""Types the block kernels read (csrc/gguf_blocks.h)."""


def is_block_type(qtype: GGMLQuantizationType) -> bool:
    return qtype in BLOCK_TYPES


@dataclass(frozen=True)
class BlockMatrix:
    """A weight [out_features, in_features] as GGUF blocks: `raw` uint8 [out, bytes per row].

    `raw` stays on the CPU for the CPU's kernels; on a GPU it moves to the device, where
    Triton kernels read it (device_linear.py, triton_blocks.py). `device` and `dtype` are
    where and in what lookups (`matrix[token_ids]`) and `dense()` come out."""

    raw: torch.Tensor
    qtype: GGMLQuantizationType
    in_features: int
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    packed: bool = False
    """`raw` holds the blocks with rows interleaved by 8 (csrc/kquant_packed.h: Q4_K, Q6_K on a
    CPU, block_kernels.BlockKernels.pack): the same bytes, a tile of 8 rows in one stream."""

    @property
    def kernel_type(self) -> int:
        """The type id the C kernels take: ggml's, with PACKED set for the packed layout."""
        return int(self.qtype) | (PACKED if self.packed else 0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.in_features

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def num_bytes(self) -> int:
        return self.raw.numel()

    @property
    def is_on_device(self) -> bool:
        """The blocks lie in GPU memory (lookups and dense() decode them there)."""
        return self.raw.device.type != "cpu"

    def dense(self) -> torch.Tensor:
        """fp32 [out, in] on `device`, equal to gguf's dequantization."""
        if self.is_on_device:
            return self._device_rows(None, torch.float32)
        return expand_rows(self.raw, self.qtype, self.in_features, self.packed).to(self.device)

    def __getitem__(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the dense matrix, e.g. token ids -> embeddings: [len(row_ids), in] in `dtype`."""
        if row_ids.dim() != 1:
            raise ValueError(f"BlockMatrix row lookup takes a 1-d index tensor, got shape "
                             f"{tuple(row_ids.shape)}")
        if self.is_on_device:  # no host round trip: a captured step looks tokens up too
            return self._device_rows(row_ids.to(self.raw.device), self.dtype)
        if self.packed:  # whole tiles of 8 rows expanded, the rows asked for taken from them
            ids = row_ids.cpu()
            tiles, inverse = torch.unique(ids // PACK_ROWS, return_inverse=True)
            rows_of = (tiles[:, None] * PACK_ROWS + torch.arange(PACK_ROWS)).reshape(-1)
            rows = expand_rows(self.raw[rows_of], self.qtype, self.in_features, packed=True)
            rows = rows.view(len(tiles), PACK_ROWS, -1)[inverse, ids % PACK_ROWS]
        else:
            rows = expand_rows(self.raw[row_ids.cpu()], self.qtype, self.in_features)
        return rows.to(self.device, self.dtype)

    def _device_rows(self, row_ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        from workers.weights.triton_blocks import expand_rows as expand_on_device

        num_rows = self.raw.shape[0] if row_ids is None else len(row_ids)
        out = torch.empty(num_rows, self.in_features, dtype=dtype, device=self.raw.device)
        return expand_on_device(self.raw, self.qtype, self.in_features, out, row_ids)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockMatrix:
        """The matrix with `fn` (a reordering of rows, e.g. the rotary un-permutation) applied."""
        if self.packed:
            raise ValueError("map_rows on packed blocks: reorder rows before packing")
        return replace(self, raw=fn(self.raw).contiguous())

    def to(self, device: str | torch.device, dtype: torch.dtype) -> BlockMatrix:
        """Lookups produce `dtype` on `device`; the blocks stay in CPU memory on a CPU and move
        to a GPU's (where no CPU kernel could read them)."""
        device = torch.device(device)
        if self.packed and device.type != "cpu":
            raise ValueError("packed blocks are the CPU kernels' layout: move the file's blocks instead")
        raw = self.raw if device.type == "cpu" else self.raw.to(device)
        return replace(self, raw=raw, device=device, dtype=dtype)


def block_matrix(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                 name: str = "tensor") -> BlockMatrix:
    """GGUF tensor data of a matrix of `shape` [out, in] -> BlockMatrix (no copy of the
    memory map beyond one contiguous read)."""
    if qtype not in BLOCK_TYPES:
        raise GGUFError(f"{name}: type {qtype.name} has no block kernel (supported: "
                        f"{', '.join(t.name for t in BLOCK_TYPES)})")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if len(shape) != 2 or shape[1] % block_size:
        raise GGUFError(f"{name}: shape {list(shape)} is not a matrix of {qtype.name} blocks "
                        f"({block_size} values)")
    rows, cols = shape
    flat = data.reshape(-1).view(np.uint8)
    if flat.size != rows * cols // block_size * type_size:
        raise GGUFError(f"{name}: data holds {flat.size} bytes, shape {list(shape)} of "
                        f"{qtype.name} needs {rows * cols // block_size * type_size} (corrupt file?)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memory map: copied right here
        raw = torch.from_numpy(np.array(flat, copy=True)).view(rows, -1)
    return BlockMatrix(raw, qtype, cols)


def expand_rows(raw: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                packed: bool = False) -> torch.Tensor:
    """uint8 [rows, bytes per row] -> fp32 [rows, in_features]: the C kernel where it is built,
    else gguf's dequantizers (dequant.py). Both equal gguf bit for bit. `packed`: whole tiles
    of the packed layout (only the C kernel reads it)."""
    from workers.weights.block_kernels import block_kernels  # (built on first use)
    from workers.weights.dequant import dequantize

    kernels = block_kernels()
    if kernels is not None:
        return kernels.dequantize(raw, qtype, in_features, packed=packed)
    if packed:
        raise ValueError("packed blocks need the C block kernels")
    return dequantize(raw.numpy(), qtype, (raw.shape[0], in_features))


def packed_copy(matrix: BlockMatrix, kernels: BlockKernels) -> BlockMatrix:
    """A copy of `matrix` in the packed layout (csrc/kquant_packed.h), where its type and shape
    have one (block_kernels.PACKABLE; rows a multiple of 8) and the build reads it (AVX2 with
    F16C); else `matrix` itself. The copy's bytes are the same, rows interleaved by 8."""
    if (matrix.packed or matrix.qtype not in PACKABLE or matrix.shape[0] % PACK_ROWS
            or matrix.in_features % GGML_QUANT_SIZES[matrix.qtype][0] or not kernels.has_packed
            or matrix.is_on_device):
        return matrix
    if matrix.raw.untyped_storage().nbytes() != matrix.raw.numel():
        return matrix  # a view of a larger tensor (an expert of a stack): a copy would add to it
    return replace(matrix, raw=kernels.pack_raw(matrix.raw, matrix.qtype, matrix.in_features), packed=True)


@dataclass(frozen=True)
class RowStack:
    """Matrices stacked along rows (a fused QKV or gate/up whose parts differ in type): the
    product with x is the parts' products side by side."""

    parts: tuple  # of Matrix (quant_blocks.Matrix), each [out_i, in]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def type_name(self) -> str:
        return "+".join(p.type_name if hasattr(p, "type_name") else str(p.dtype) for p in self.parts)

    def dense(self) -> torch.Tensor:
        return torch.cat([p if isinstance(p, torch.Tensor) else p.dense() for p in self.parts])

    def __getitem__(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the dense matrix (a stack is never an embedding table: no lookups to speed)."""
        return self.dense()[row_ids.to(self.device)]

    def to(self, device: str | torch.device, dtype: torch.dtype) -> RowStack:
        return RowStack(tuple(p.to(device=device, dtype=dtype) if isinstance(p, torch.Tensor)
                              else p.to(device, dtype) for p in self.parts))
