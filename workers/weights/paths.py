"""`--weights fp32|bf16|q4|auto`: which copies of the weights a model keeps and which kernel a
step's matmuls take.

- fp32: every tensor dequantized at load, dense kernels (oneDNN fp32 on CPU, bf16 cuBLAS on GPU).
- bf16: dense like fp32, but on CPU the matrices are kept in bf16 and multiplied by oneDNN's
  bf16 kernels (inputs rounded to bf16, fp32 accumulation; everything between the matmuls stays
  fp32). Only where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere it is
  emulated and slower than fp32, so the mode runs fp32 with a warning. On GPU it is fp32's path,
  which already computes in bf16.
- q4: Q4_0/Q4_1/Q8_0 matrices stay 4-bit (quant_blocks.py) and run on torch's int4 weight-only
  kernels (quant_linear.py); matrices of other types, and norms, stay dense.
- auto: both copies of each such matrix (DualLinear). A matmul of at most the crossover rows
  takes the 4-bit kernel, a larger one the dense kernel. Every matmul of a step's layers has the
  step's token count as rows, so a step takes one path for its layers; the head sees the rows
  being sampled. The crossovers were measured (python -m tools.bench quant --crossover-only,
  figures in docs/quantization.md), not guessed; they differ for Q4 (one plane) and Q8_0 (two
  planes).
Owns: the mode, the crossover figures, building the model. Does not own: kernels or loading.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from justapi.config.sections import WEIGHT_MODES
from justapi.model.gguf_file import GGUFFile
from workers.model.forward import Linear, LinearLike, DecoderModel, has_onednn_bf16
from workers.weights.gguf_loader import load_weights
from workers.weights.quant_blocks import Matrix
from workers.weights.quant_linear import (
    DualLinear,
    Int4Linear,
    has_int4_kernel,
    require_int4_kernel,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Crossover:
    """Most rows per matmul for which the 4-bit kernel was measured faster than the dense one."""

    q4_rows: int
    """Q4_0 / Q4_1 matrices (the layers of the default model)."""
    q8_rows: int
    """Q8_0 matrices (two 4-bit planes: twice the kernel work; the default model's tied head)."""

    def max_quant_rows(self, num_planes: int) -> int:
        """0: the dense kernel at every size (auto then keeps no 4-bit copy)."""
        return self.q4_rows if num_planes == 1 else self.q8_rows


CPU_CROSSOVER = Crossover(q4_rows=24, q8_rows=4)
"""2-core x86-64 (AVX2, no hardware bf16), torch 2.13, SmolLM2-135M, paired timings of both
kernels (python -m tools.bench quant --crossover-only, twice): the layers' int4 matmuls win up
to 16-24 rows, the Q8_0 head's (two planes) up to 4. See docs/quantization.md."""
CUDA_CROSSOVER = Crossover(q4_rows=0, q8_rows=0)
"""NVIDIA H200, tinygemm vs cuBLAS bf16, SmolLM2's shapes: int4 never won (its steps are
launch-bound below ~128 rows, and slower above): auto on CUDA computes dense, q4 saves memory.
See docs/quantization.md."""


def has_hardware_bf16() -> bool:
    """This CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles)."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)()
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def default_crossover(device: torch.device) -> Crossover:
    return CUDA_CROSSOVER if device.type == "cuda" else CPU_CROSSOVER


class WeightPaths:
    """The linear factory of DecoderModel for one mode: `paths(weight)` -> the weight's linear."""

    def __init__(self, mode: str, device: str | torch.device = "cpu",
                 crossover: Crossover | None = None) -> None:
        if mode not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {mode!r}")
        self.device = torch.device(device)
        if mode == "q4":
            require_int4_kernel(self.device)
        elif mode == "auto" and not has_int4_kernel(self.device):
            logger.warning("no int4 weight-only kernel on %s: --weights auto runs fp32", self.device)
            mode = "fp32"
        elif mode == "bf16" and self.device.type == "cpu" and not (has_hardware_bf16() and has_onednn_bf16()):
            logger.warning("this CPU has no bf16 matmul instructions (AVX512-BF16 or AMX): "
                           "--weights bf16 runs fp32, which is faster here")
            mode = "fp32"
        elif mode == "bf16" and self.device.type != "cpu":
            mode = "fp32"  # the GPU forward computes in bf16 already
        self.mode = mode
        self.crossover = crossover or default_crossover(self.device)

    @property
    def keeps_quantized(self) -> bool:
        return self.mode in ("q4", "auto")

    def __call__(self, weight: Matrix) -> LinearLike:
        if self.mode == "bf16":
            return Linear(weight, torch.bfloat16)
        if isinstance(weight, torch.Tensor) or self.mode == "fp32":
            return Linear(weight)
        max_quant_rows = self.crossover.max_quant_rows(weight.num_planes)
        if self.mode == "auto" and max_quant_rows == 0:  # the int4 kernel never wins here
            return Linear(weight)
        quant = Int4Linear(weight, self.device)
        if self.mode == "q4":
            return quant
        return DualLinear(Linear(weight), quant, max_quant_rows)


def load_model(gguf: GGUFFile, device: str = "cpu", dtype: torch.dtype = torch.float32,
               weights: str = "fp32", progress: bool = True,
               crossover: Crossover | None = None) -> DecoderModel:
    """The model of a GGUF file with the weights kept and computed as `weights` says."""
    paths = WeightPaths(weights, device, crossover)
    loaded = load_weights(gguf, device, dtype, progress, keep_quantized=paths.keeps_quantized)
    return DecoderModel(loaded, paths)
