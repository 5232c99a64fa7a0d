"""The CPU kernels that read GGUF blocks in place (workers/model/csrc/quant_matmul.c), called
with torch tensors.

- `matmul(matrix, x)`: y = x @ W.T, x rounded to 8 bits per 32 values (llama.cpp's Q8_0
  activations) and integer dot products with the weights' codes (`panels=True`: the same
  arithmetic with x's rows in panels, for steps of many rows);
- `dequantize(raw, qtype, in_features, out=...)`: rows expanded to fp32 or bf16 (lookups, and
  the tiles large steps multiply with a dense GEMM).
Both compute a row of x in one fixed order whatever the other rows are, and give each other's bits.
Built by workers/model/cpu_kernels.py (per CPU, -march=native); None where it cannot be.
Owns: the calls. Does not own: which path a step takes (block_linear.py, path_plan.py).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Protocol

import torch
from gguf import GGMLQuantizationType

from workers.model.cpu_kernels import load_kernel

PACKED = 0x100
"""Set in a kernel type id: the blocks are in the packed layout (csrc/kquant_packed.h)."""
PACK_ROWS = 8
"""Rows per tile of the packed layout."""
PACKABLE = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
            GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
_STATUS = {-1: "out of memory", -3: "unsupported type", -4: "row length is not whole blocks"}


class Blocks(Protocol):
    """What a matmul reads of a matrix kept as GGUF blocks (block_matrix.BlockMatrix)."""

    @property
    def raw(self) -> torch.Tensor: ...  # uint8 [out_features, bytes per row]

    @property
    def qtype(self) -> GGMLQuantizationType: ...

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def type_name(self) -> str: ...

    @property
    def kernel_type(self) -> int: ...  # the type id the kernels take (block_matrix.PACKED: packed layout)


class BlockKernels:
    """quant_matmul.c's entry points."""

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        for name in ("quant_matmul_i8", "quant_matmul_i8_panels"):  # type: the matrix's kernel_type
            fn = getattr(library, name)
            fn.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i32]
            fn.restype = i32
        library.quant_dequantize.argtypes = [i32, ptr, i64, i64, ptr, i32, i32]
        library.quant_dequantize.restype = i32
        library.quant_pack8.argtypes = [i32, ptr, i64, i64, i32]
        library.quant_pack8.restype = i32
        library.quant_has_panels.argtypes = []
        library.quant_has_panels.restype = i32
        library.quant_has_packed.argtypes = []
        library.quant_has_packed.restype = i32
        self.library = library
        self.has_panels = bool(library.quant_has_panels())
        """Whether `matmul(..., panels=True)` runs here (x86 with AVX2)."""
        self.has_packed = self.has_panels and bool(library.quant_has_packed())
        """Whether the matmuls read the packed layout here (AVX2 with F16C)."""

    def matmul(self, matrix: Blocks, x: torch.Tensor, panels: bool = False) -> torch.Tensor:
        """x fp32 [rows, in] -> fp32 [rows, out]; `panels`: the int8 arithmetic with x's rows
        in panels of 8 (one int32 lane each), for steps of many rows."""
        out_features, in_features = matrix.shape
        x = x.to(torch.float32).contiguous()
        if x.dim() != 2 or x.shape[1] != in_features:
            raise ValueError(f"x of shape {tuple(x.shape)} does not match a {out_features}x{in_features} weight")
        y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        library = self.library
        fn = library.quant_matmul_i8_panels if panels else library.quant_matmul_i8
        _check(fn(matrix.kernel_type, matrix.raw.data_ptr(), out_features, in_features, x.data_ptr(),
                  x.shape[0], y.data_ptr(), torch.get_num_threads()), matrix.type_name)
        return y

    def pack_raw(self, raw: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
        """A copy of blocks `raw` (uint8 [rows, bytes per row] of a PACKABLE type, rows a
        multiple of PACK_ROWS) in the packed layout: the same bytes, rows interleaved by 8
        (block_matrix.packed_copy decides which matrices)."""
        out = raw.contiguous().clone()
        _check(self.library.quant_pack8(int(qtype), out.data_ptr(), out.shape[0], in_features,
                                        torch.get_num_threads()), qtype.name)
        return out

    def dequantize(self, raw: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                   out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                   packed: bool = False) -> torch.Tensor:
        """uint8 [rows, bytes per row] -> [rows, in_features] in `dtype` (fp32 or bf16), into `out`
        if given (a contiguous tensor of that shape and dtype). `packed`: raw is whole tiles of
        the packed layout."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dequantize produces fp32 or bf16, not {dtype}")
        raw = raw.contiguous()
        if out is None:
            out = torch.empty(raw.shape[0], in_features, dtype=dtype)
        if not out.is_contiguous() or out.dtype != dtype or tuple(out.shape) != (raw.shape[0], in_features):
            raise ValueError(f"out must be a contiguous {dtype} tensor [{raw.shape[0]}, {in_features}]")
        _check(self.library.quant_dequantize(int(qtype) | (PACKED if packed else 0), raw.data_ptr(), raw.shape[0],
                                             in_features,
                                             out.data_ptr(), int(dtype == torch.bfloat16),
                                             torch.get_num_threads()), qtype.name)
        return out


def _check(status: int, type_name: str) -> None:
    if status == -1:
        raise MemoryError("block matmul kernel: out of memory for its scratch buffers")
    if status != 0:
        raise ValueError(f"block kernel on {type_name}: {_STATUS.get(status, f'status {status}')}")


@functools.cache
def block_kernels() -> BlockKernels | None:
    """The kernels, or None (with one warning) where they cannot be built here."""
    return load_kernel("quant_matmul", BlockKernels, "quantized weights are expanded instead")
