"""Weight-only 4-bit matmuls: a QuantMatrix repacked once into torch's int4 kernel layout.

torch's int4 kernels compute y = x @ W.T with W[n, k] = (code - 8) * scale + zero per group of
32 inputs, from a packed code tensor and a `[k / 32, n, 2]` (scale, zero) tensor. A GGUF group
`d * code + m` is that with scale = d and zero = m + 8d (Q4_0 and Q8_0's planes: zero = 0 or 8d).
- CPU: `_convert_weight_to_int4pack_for_cpu` + `_weight_int4pack_mm_for_cpu`. Its AVX2/AVX-512
  code runs only for bf16 (activations, scales and zeros bf16, fp32 accumulation, bf16 out); with
  fp32 inputs it takes a scalar loop ~30x slower, so inputs are cast to bf16 and back.
- CUDA (sm80+): `_convert_weight_to_int4pack` + `_weight_int4pack_mm` (tinygemm), bf16.
Rows are padded to a multiple of 16 (both kernels tile n). Owns: the repack and the call.
Does not own: the GGUF blocks (quant_blocks.py) or which form a weight takes (paths.py).
"""
from __future__ import annotations

import torch

from workers.weights.quant_blocks import GROUP_SIZE, QuantMatrix

ROW_MULTIPLE = 16
"""Output rows are padded to this: the CPU kernel handles n in blocks of 16/32/64, tinygemm 8."""


class QuantKernelError(RuntimeError):
    """This device/torch has no int4 weight-only kernel; the message says what to use instead."""


def has_int4_kernel(device: torch.device) -> bool:
    if device.type == "cpu":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    if device.type == "cuda":
        return (torch.cuda.is_available() and torch.version.hip is None
                and torch.cuda.get_device_capability(device) >= (8, 0))
    return False


def require_int4_kernel(device: torch.device) -> None:
    if not has_int4_kernel(device):
        raise QuantKernelError(
            f"no int4 weight-only kernel on device {device} (CPU needs torch's "
            "_weight_int4pack_mm_for_cpu, CUDA an sm80+ NVIDIA GPU); use --weights fp32")


def _scales_and_zeros(matrix: QuantMatrix, num_rows: int) -> torch.Tensor:
    """bf16 [groups, num_rows, 2]: (d, m + 8d) per group, zero rows past the matrix."""
    pairs = torch.stack([matrix.d, matrix.m + 8.0 * matrix.d], dim=-1)  # [out, groups, 2] fp32
    pairs = torch.nn.functional.pad(pairs, (0, 0, 0, 0, 0, num_rows - pairs.shape[0]))
    return pairs.transpose(0, 1).contiguous().to(torch.bfloat16)


def _inner_k_tiles(k: int) -> int:
    """tinygemm packs 2, 4 or 8 k-tiles of 16 together; the most that divides k."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


class Int4Linear:
    """y = x @ W.T with W kept as 4-bit codes (QuantMatrix) in the int4 kernel's layout.

    x [rows, in] in any float dtype; y [rows, out] in x's dtype. A Q8_0 matrix has two planes:
    the kernel runs over [x | x] (see quant_blocks.py)."""

    def __init__(self, matrix: QuantMatrix, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        require_int4_kernel(self.device)
        self.out_features, self.in_features = matrix.shape
        self.num_planes = matrix.num_planes
        self.type_name = matrix.type_name
        self.num_calls = 0  # kernel calls: tests count them to see which path a step took
        rows = -(-self.out_features // ROW_MULTIPLE) * ROW_MULTIPLE
        codes = torch.nn.functional.pad(matrix.codes(), (0, 0, 0, rows - self.out_features))
        self.scales_and_zeros = _scales_and_zeros(matrix, rows).to(self.device)
        if self.device.type == "cpu":  # int32 [rows, k] codes -> uint8 [rows, k / 2] blocked
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        else:  # uint8 [rows, k / 2], code 2i in the high nibble -> int32 tensor-core tiles
            pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(self.device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(codes.shape[1]))

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.num_calls += 1
        xb = x.to(torch.bfloat16)  # [rows, in]
        if self.num_planes > 1:
            xb = xb.repeat(1, self.num_planes)  # [rows, planes * in]
        xb = xb.contiguous()
        if self.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE,
                                                            self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(xb, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y[:, :self.out_features].to(x.dtype)  # [rows, out]

    def warm_up(self, max_rows: int, min_rows: int = 1) -> None:
        """Nothing to build: the kernel keeps no per-shape state."""
