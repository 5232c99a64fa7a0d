"""A MoE layer's experts in one grouped matmul per projection, with no host sync: what a GPU
step needs to be captured in a graph (the per-expert loop reads each expert's row count on the
host, `counts.tolist()`, which a capture cannot do).

Each (row, choice) pair is an *entry*: entry j is row j // k's j % k-th expert. Entries are
sorted by expert on the device and laid out in tiles of BLOCK_M, each expert's tiles padded
(entry -1), in a buffer sized for the worst case (every expert's last tile one entry short):

    entry_ids:     | e0: 5 entries, pad | e1: 0 tiles | e2: 2 entries, pad | unused: -1 ... |
    tile_experts:  |  0                 |             |  2                 | -1 (skipped)   |

One program multiplies one tile by one block of output features of its expert's matrix: the
experts' matrices are stacked ([E * out, in] dense, or the GGUF blocks of one type, decoded
in the kernel as triton_blocks.py does). Each output element is one program's fixed-order sum,
and a row's k results are added in choice order: the same bits every run.
Owns: the stack, the layout, the kernel. Does not own: routing or the shared expert (ffn.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import no_type_check

import torch

from workers.model.triton_attention import _jit
from workers.weights.block_matrix import BlockMatrix
from workers.weights.triton_blocks import DEVICE_BLOCK_TYPES, _groups, groups_per_chunk

try:
    import triton.language as tl
except ImportError:  # never launched without Triton
    tl = None  # type: ignore[assignment]

BLOCK_M = 16
"""Entries per tile (the smallest tile Triton's dot takes)."""
BLOCK_N = 32


@_jit
@no_type_check
def _grouped_kernel(x_ptr, w_ptr, half_ptr, i8_ptr, out_ptr, entry_ids_ptr, tile_experts_ptr,
                    num_n, num_chunks, stride_xm, stride_w, stride_om,
                    ROW_DIV: tl.constexpr, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, G: tl.constexpr, IS_FP32: tl.constexpr):
    """out[entry, n] = x[entry // ROW_DIV] . W_expert[n] for the tile's entries."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    entries = tl.load(entry_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = entries >= 0
    x_rows = tl.where(ok, entries // ROW_DIV, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < num_n
    rows = (tl.maximum(expert, 0) * num_n + tl.where(n_ok, n, 0)).to(tl.int64)  # rows of the stack
    kk = tl.arange(0, G * 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for chunk in range(0, tl.where(expert >= 0, num_chunks, 0)):  # a padding tile reads nothing
        k = chunk * G * 32 + kk
        x = tl.load(x_ptr + x_rows[:, None] * stride_xm + k[None, :], mask=ok[:, None], other=0.0)
        if QTYPE == 0:  # dense rows
            w = tl.load(w_ptr + rows[:, None] * stride_w + k[None, :])
        else:
            g = chunk * G + tl.arange(0, G)[None, :, None]
            w = tl.reshape(_groups(w_ptr, half_ptr, i8_ptr, (rows * stride_w)[:, None, None], g, QTYPE),
                           (BLOCK_N, G * 32))
        if IS_FP32:
            acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = out_ptr + entries[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class ExpertStack:
    """Every expert's matrix of one projection, stacked: [E * out, in] dense (`qtype` None) or
    uint8 [E * out, bytes per row] of one GGUF type."""

    weight: torch.Tensor
    num_experts: int
    out_features: int
    in_features: int
    qtype: object = None  # GGMLQuantizationType of the blocks, None when dense

    @classmethod
    def of(cls, matrices: list, dtype: torch.dtype) -> ExpertStack:
        """Stacked from per-expert matrices: blocks when all are blocks of one type the kernels
        read, else dense in `dtype` (experts of mixed forms are rare: dequantized)."""
        out_features, in_features = matrices[0].shape
        if all(isinstance(m, BlockMatrix) for m in matrices) and len({m.qtype for m in matrices}) == 1 \
                and matrices[0].qtype in DEVICE_BLOCK_TYPES:
            return cls(torch.cat([m.raw for m in matrices]), len(matrices), out_features, in_features,
                       matrices[0].qtype)
        dense = [m if isinstance(m, torch.Tensor) else m.dense().to(m.device) for m in matrices]
        return cls(torch.cat(dense).to(dtype).contiguous(), len(matrices), out_features, in_features)

    def expert(self, index: int) -> torch.Tensor | BlockMatrix:
        """Expert `index`'s matrix as a view of the stack (its own linear reads it: no copy)."""
        rows = self.weight[index * self.out_features:(index + 1) * self.out_features]
        if self.qtype is None:
            return rows
        return BlockMatrix(rows, self.qtype, self.in_features, rows.device)  # type: ignore[arg-type]

    def matmul(self, x: torch.Tensor, layout: GroupedLayout, row_div: int) -> torch.Tensor:
        """[num_entries, out]: entry j's row x[j // row_div] times its expert's matrix."""
        x = x.contiguous()
        out = torch.empty(layout.num_entries, self.out_features, dtype=x.dtype, device=x.device)
        flat = self.weight.reshape(-1)
        is_blocks = self.qtype is not None
        half, i8 = (flat.view(torch.float16), flat.view(torch.int8)) if is_blocks else (flat, flat)
        grid = (len(layout.tile_experts), -(-self.out_features // BLOCK_N))
        _grouped_kernel[grid](
            x, self.weight, half, i8, out, layout.entry_ids, layout.tile_experts,
            self.out_features, self.in_features // (32 * groups_per_chunk(self.in_features)),
            x.stride(0), self.weight.stride(0), out.stride(0),
            ROW_DIV=row_div, QTYPE=int(self.qtype) if is_blocks else 0,  # type: ignore[call-overload]
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, G=groups_per_chunk(self.in_features),
            IS_FP32=x.dtype == torch.float32)
        return out


@dataclass(frozen=True)
class GroupedLayout:
    entry_ids: torch.Tensor  # int32 [capacity]: entries in tiles by expert, -1 padding
    tile_experts: torch.Tensor  # int32 [capacity / BLOCK_M]: each tile's expert, -1 unused
    num_entries: int


def grouped_layout(experts: torch.Tensor, num_experts: int) -> GroupedLayout:
    """experts [T, k] (each row's choices) -> the tiles, with device ops only (no sync: the
    capacity follows from the shapes alone)."""
    flat = experts.reshape(-1)  # [T * k]
    num_entries, device = flat.numel(), flat.device
    capacity = -(-(num_entries + num_experts * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))  # bincount, which syncs on a GPU to size its output
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # entries grouped by expert, in row order within
    by_expert = flat[order]
    rank = torch.arange(num_entries, device=device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    entry_ids = torch.full((capacity,), -1, dtype=torch.int32, device=device)
    entry_ids[(padded_end - padded)[by_expert] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, BLOCK_M, device=device)
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True)  # E: past every expert
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return GroupedLayout(entry_ids, tile_experts, num_entries)
