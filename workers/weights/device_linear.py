"""`--weights auto` on a GPU: y = x @ W.T for a weight kept as the file's GGUF blocks in device
memory (memory: the file's bytes, plus one shared tile), on the path the step's row count picks:

- rows <= fused_rows (decode batches, verification): the blocks are decoded inside the matmul
  kernel (triton_blocks.block_matmul), so a step streams the file's bytes, not 4x as many;
- more rows (prefill chunks, large batches): tiles of rows are expanded to the compute dtype
  in a scratch buffer every linear of the model shares, each multiplied by torch's matmul
  (cuBLAS), as the CPU's dense path does (block_linear.py).

Before a type is kept so, `device_kernels_work` runs both kernels once on a small matrix of it
against gguf's dequantization (a kernel that fails to compile or disagrees leaves that type
dequantized at load, with a warning, instead of serving wrong numbers).
Owns: the path per step and the shared tile. Does not own: the kernels (triton_blocks.py).
"""
from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch
from gguf import GGMLQuantizationType

from workers.weights.block_matrix import BlockMatrix
from workers.weights.triton_blocks import DEVICE_BLOCK_TYPES, block_matmul, expand_rows

logger = logging.getLogger(__name__)

FUSED_ROWS = int(os.environ.get("JUSTAPI_GPU_FUSED_ROWS", "64"))
"""Most rows a step multiplies with the in-kernel decode; above, expanded tiles and cuBLAS.
At 64 rows the fused kernel still reads each weight once for the whole step; an expanded
matrix is written and read again in bf16 (4.5x a Q4_K matrix's bytes), which only a step of
many rows hides behind its compute. Unmeasured on a GPU (docs/bench.md)."""
TILE_BYTES = 64 << 20
"""Most bytes of the shared expanded tile: a ~1B model's largest layer matrix in bf16 (gate/up
16384 x 2048) in one tile; bigger matrices (an 8B's output head) go in several."""
PATHS = ("fused", "expand")


class DeviceScratch:
    """The tile every DeviceBlockLinear of a model expands into (a forward runs one matmul at a
    time, on one stream). Sized while the model is built, before any graph is captured (a
    graph keeps the address it was captured with)."""

    def __init__(self, device: torch.device, max_bytes: int = TILE_BYTES) -> None:
        self.device, self.max_bytes = device, max_bytes
        self.buffer = torch.empty(0, dtype=torch.uint8, device=device)

    def rows_per_tile(self, num_rows: int, in_features: int, dtype: torch.dtype) -> int:
        fit = max(16, self.max_bytes // (in_features * dtype.itemsize) // 16 * 16)
        return min(num_rows, fit)

    def reserve(self, rows: int, cols: int, dtype: torch.dtype) -> None:
        need = rows * cols * dtype.itemsize
        if self.buffer.numel() < need:
            self.buffer = torch.empty(need, dtype=torch.uint8, device=self.device)

    def view(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        need = rows * cols * dtype.itemsize
        assert self.buffer.numel() >= need, "the tile was reserved when the linear was made"
        return self.buffer[:need].view(dtype).view(rows, cols)


class DeviceBlockLinear:
    """The linear of one BlockMatrix whose blocks are in device memory. `num_calls[path]`
    counts the calls each path served (tests read it)."""

    def __init__(self, matrix: BlockMatrix, scratch: DeviceScratch, compute_dtype: torch.dtype,
                 fused_rows: int = FUSED_ROWS) -> None:
        self.matrix, self.scratch, self.fused_rows = matrix, scratch, fused_rows
        self.out_features, self.in_features = matrix.shape
        self.num_calls = {path: 0 for path in PATHS}
        scratch.reserve(scratch.rows_per_tile(self.out_features, self.in_features, compute_dtype),
                        self.in_features, compute_dtype)
        self.compute_dtype = compute_dtype

    @property
    def num_bytes(self) -> int:
        return self.matrix.num_bytes

    def path_for(self, num_rows: int) -> str:
        return "fused" if num_rows <= self.fused_rows else "expand"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path_for(x.shape[0])
        self.num_calls[path] += 1
        return self.run(path, x)

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] in x's dtype on `path`, whatever the row count."""
        m = self.matrix
        if path == "fused":
            return block_matmul(x.contiguous(), m.raw, m.qtype, m.in_features)
        if path != "expand":
            raise ValueError(f"unknown device weight path {path!r} (known: {', '.join(PATHS)})")
        step = self.scratch.rows_per_tile(self.out_features, self.in_features, self.compute_dtype)
        dtype = self.compute_dtype
        xd = x.to(dtype)
        if step >= self.out_features:  # one tile: the whole matrix
            return (xd @ self._tile(0, self.out_features).T).to(x.dtype)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for n0 in range(0, self.out_features, step):  # out[:, n0:n1] = x @ W[n0:n1].T
            n1 = min(self.out_features, n0 + step)
            out[:, n0:n1] = xd @ self._tile(n0, n1).T
        return out

    def _tile(self, n0: int, n1: int) -> torch.Tensor:
        tile = self.scratch.view(n1 - n0, self.in_features, self.compute_dtype)
        return expand_rows(self.matrix.raw, self.matrix.qtype, self.in_features, tile, first_row=n0)

    def warm_up(self, max_rows: int, min_rows: int = 1) -> None:
        """Nothing to build ahead: Triton compiles on first launch, which graph capture does."""


@functools.cache
def device_kernels_work(qtype: GGMLQuantizationType, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels decode `qtype` right on `device`: both paths, at 1 and 5 rows, and
    row lookups, against gguf's dequantization of one random 48 x 512 matrix."""
    from workers.weights.kquant_pack import dequantize, quantize

    if qtype not in DEVICE_BLOCK_TYPES:
        return False
    rows, cols = 48, 512
    values = np.random.default_rng(int(qtype)).standard_normal((rows, cols)).astype(np.float32)
    raw_np = np.ascontiguousarray(quantize(values, qtype)).reshape(rows, -1)
    want = torch.from_numpy(dequantize(raw_np, qtype, (rows, cols)))  # fp32 [rows, cols]
    try:
        matrix = BlockMatrix(torch.from_numpy(raw_np.copy()), qtype, cols).to(device, dtype)
        ids = torch.tensor([7, 0, 47, 7], device=device)
        looked_up = want[ids.cpu()]
        rounding = 1e-6 if dtype == torch.float32 else 8e-3  # a GPU may fuse d * q - m (one FMA)
        _require_close("lookup", matrix[ids], looked_up, rounding * float(looked_up.abs().max()))
        linear = DeviceBlockLinear(matrix, DeviceScratch(device), dtype)
        for num_rows in (1, 5):
            x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows))
            reference = x.to(dtype).float() @ want.to(dtype).float().T
            tolerance = (1e-4 if dtype == torch.float32 else 2e-2) * float(reference.abs().max())
            for path in PATHS:
                got = linear.run(path, x.to(device, dtype))
                _require_close(f"{path} matmul at {num_rows} rows", got, reference, tolerance)
    except Exception as exc:  # a compile error, a launch error or a wrong number: dequantize instead
        logger.warning("GGUF %s blocks on %s: the device kernels failed their check (%s); weights "
                       "of this type are dequantized at load", qtype.name, device, exc)
        return False
    return True


def _require_close(what: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    error = float((got.float().cpu() - want).abs().max())
    if not error <= tolerance:  # NaN fails too
        raise RuntimeError(f"{what}: off by {error:.3g} (tolerance {tolerance:.3g})")
