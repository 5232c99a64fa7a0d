"""`--weights auto` on CPU: y = x @ W.T for a weight kept as the file's GGUF blocks, on the path
the step's row count picks (path_plan.py).

Small steps (decode, verification) run the block kernels over the blocks in place; large ones
(prefill) expand one tile of rows at a time into a scratch buffer shared by the whole model
and multiply it with a dense GEMM, so no dense copy of any matrix outlives the call: memory is
the file's blocks plus one tile (TileScratch). Owns: running a path. Does not own: the plan.
"""
from __future__ import annotations

import torch

from workers.model.forward import has_onednn_linear, onednn_rows
from workers.weights.block_kernels import BlockKernels
from workers.weights.block_matrix import BlockMatrix
from workers.weights.path_plan import PATHS, PathPlan

TILE_BYTES = 8 << 20
"""Most bytes of one expanded tile: 512 rows of a 4096-wide fp32 matrix. Large enough that a
GEMM on it runs at full speed (SmolLM2's largest layer matrix, gate/up 3072 x 576, is 7 MB: one
tile), small next to the blocks of any model (SmolLM2 Q4_1: 92 MiB; 32 MiB would put its
resident memory past 1.3x the file), and it stays in a server CPU's L3 between expansion and
GEMM."""
ROW_MULTIPLE = 16
HAS_ONEDNN = has_onednn_linear()


class TileScratch:
    """The one buffer every BlockLinear of a model expands its tiles into (a forward runs one
    matmul at a time). It grows to the largest tile asked for, at most `max_bytes`."""

    def __init__(self, max_bytes: int = TILE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def rows_per_tile(self, num_rows: int, in_features: int, dtype: torch.dtype) -> int:
        fit = self.max_bytes // (in_features * dtype.itemsize)
        return min(num_rows, max(ROW_MULTIPLE, fit // ROW_MULTIPLE * ROW_MULTIPLE))

    def view(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        need = rows * cols * dtype.itemsize
        if self.buffer.numel() < need:
            self.buffer = torch.empty(need, dtype=torch.uint8)
        return self.buffer[:need].view(dtype).view(rows, cols)


class BlockLinear:
    """The linear of one BlockMatrix under a PathPlan. `num_calls[path]` counts the calls each
    path served (tests read it to see which path a step took)."""

    def __init__(self, matrix: BlockMatrix, kernels: BlockKernels, plan: PathPlan,
                 scratch: TileScratch) -> None:
        self.matrix, self.kernels, self.plan, self.scratch = matrix, kernels, plan, scratch
        self.out_features, self.in_features = matrix.shape
        self.num_calls = {path: 0 for path in PATHS}

    @property
    def num_bytes(self) -> int:
        return self.matrix.num_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        path = self.plan.path_for(x.shape[0])
        self.num_calls[path] += 1
        return self.run(path, x)

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> fp32 [rows, out] on `path`, whatever the plan says."""
        if path in ("int8", "int8_panels"):
            return self.kernels.matmul(self.matrix, x, panels=path == "int8_panels")
        if path in ("dense", "dense_bf16"):
            return self._dense(x, torch.bfloat16 if path == "dense_bf16" else torch.float32)
        raise ValueError(f"unknown weight path {path!r} (known: {', '.join(PATHS)})")

    def _dense(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Tiles of rows [n0, n1) expanded into the scratch, each multiplied densely:
            out[:, n0:n1] = x @ W[n0:n1].T"""
        num_out = self.out_features
        step = self.scratch.rows_per_tile(num_out, self.in_features, dtype)
        xd = x.to(dtype)
        if step == num_out:  # one tile: the whole matrix
            return self._gemm(xd, self._tile(0, num_out, dtype)).float()
        out = torch.empty(x.shape[0], num_out, dtype=torch.float32)
        for n0 in range(0, num_out, step):
            n1 = min(num_out, n0 + step)
            out[:, n0:n1] = self._gemm(xd, self._tile(n0, n1, dtype))
        return out

    @staticmethod
    def _gemm(x: torch.Tensor, tile: torch.Tensor) -> torch.Tensor:
        """x @ tile.T: oneDNN's inner product on the plain tile where torch has it (SmolLM2's
        gate/up at 512 rows: 15 ms, against 26 ms for MKL's x @ W.T), rows padded to the
        buckets fp32's Linear uses, so oneDNN keeps few primitives."""
        if not HAS_ONEDNN:
            return x @ tile.T
        rows = x.shape[0]
        padded = onednn_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(x, tile, None, "none", [], "")
        return out[:rows] if padded != rows else out

    def _tile(self, n0: int, n1: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [n0, n1) expanded into the scratch: [n1 - n0, in]."""
        return self.kernels.dequantize(self.matrix.raw[n0:n1], self.matrix.qtype, self.in_features,
                                       out=self.scratch.view(n1 - n0, self.in_features, dtype), dtype=dtype,
                                       packed=self.matrix.packed)  # packed: n0, n1 whole tiles (ROW_MULTIPLE)

    def warm_up(self, max_rows: int, min_rows: int = 1) -> None:
        """Grow the shared scratch now to the tile the dense paths will need, so serving does
        not raise the worker's memory later."""
        for path in {self.plan.path_for(rows) for rows in (min_rows, max_rows)}:
            if path in ("dense", "dense_bf16"):
                dtype = torch.bfloat16 if path == "dense_bf16" else torch.float32
                rows = self.scratch.rows_per_tile(self.out_features, self.in_features, dtype)
                self.scratch.view(rows, self.in_features, dtype)


class StackLinear:
    """The linear of a RowStack: each part's own linear, outputs side by side."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=1)  # [rows, sum of outs]

    def warm_up(self, max_rows: int, min_rows: int = 1) -> None:
        for part in self.parts:
            part.warm_up(max_rows, min_rows)
