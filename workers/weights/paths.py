"""`--weights fp32|bf16|q4|auto`: which form of the weights a model keeps and which kernel a
step's matmuls take.

- fp32: every tensor dequantized at load, dense kernels (oneDNN fp32 on CPU, bf16 cuBLAS on GPU).
- bf16: dense like fp32, but on CPU the matrices are kept in bf16 and multiplied by oneDNN's
  bf16 kernels (inputs rounded to bf16, fp32 accumulation; everything between the matmuls stays
  fp32). Only where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere it is
  emulated and slower than fp32, so the mode runs fp32 with a warning. On GPU it is fp32's path,
  which already computes in bf16.
- q4: matrices whose type maps exactly onto 4-bit planes (Q4_0, Q4_1, Q8_0, Q4_K, Q5_0, Q5_1,
  Q5_K: quant_blocks.py) run on torch's int4 weight-only kernels (quant_linear.py); on CPU the
  other block types (Q6_K, Q3_K, Q2_K) stay GGUF blocks as under auto; norms stay dense.
- auto (CPU): every quantized matrix stays the file's GGUF blocks (block_matrix.py) and nothing
  else: memory is the file's. Each matmul takes the path the step's row count picks from a
  plan measured on this machine at start-up per weight type and shape (path_plan.py: the block
  kernels with int8 activations, per row or in panels, for small steps, a tile expanded into a
  scratch buffer and a dense fp32 or bf16 GEMM for large ones), cached per CPU. Without a C
  compiler auto runs fp32. On CUDA with Triton, auto keeps the blocks in device memory
  (device_linear.py: the blocks decoded inside the matmul for small steps, expanded bf16 tiles
  and cuBLAS for large ones) for every type whose kernels pass their check at start
  (triton_blocks.py types); other types are dequantized to bf16. Without Triton auto is fp32
  (bf16) there. A file with quantized matrices of a type no CPU kernel reads (IQ3_S, IQ2_XXS,
  ...) is refused under auto and q4 on CPU (justapi/model/weight_types.py): expanding them
  would be ~8x the file.
Owns: the mode, the form per type, building the model. Does not own: kernels or loading.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import time
from typing import Any

import torch
from gguf import GGMLQuantizationType

from justapi.config.sections import WEIGHT_MODES
from justapi.model.gguf_file import GGUFFile
from justapi.model.weight_types import check_weight_types
from workers.cpu_memory import release_freed_memory
from workers.model.cpu_kernels import KernelBuildError, cache_dir, cpu_id
from workers.model.kernel_records import (PLANS_FILE, QUIET_SHARE, BusyProbe, cpu_name, plan_kernel_source,
                                          plan_source_digest)
from workers.model.cpu_layer_chain import LayerChain
from workers.model.forward import DecoderModel, Linear, LinearLike, has_onednn_bf16
from workers.weights.block_kernels import BlockKernels, block_kernels
from workers.weights.block_linear import BlockLinear, StackLinear, TileScratch
from workers.weights.block_matrix import BlockMatrix, RowStack, is_block_type, packed_copy
from workers.weights.gguf_loader import load_weights
from workers.weights.path_plan import CHECK_ROWS, INT8_FAMILY, PathPlan, PathTimer, settle_plan
from workers.weights.plan_cache import PlanCache, PlanRecord
from workers.weights.quant_blocks import Matrix, QuantMatrix, is_quantizable, planes_of
from workers.weights.quant_linear import Int4Linear, require_int4_kernel

logger = logging.getLogger(__name__)
PACK_ENV = "JUSTAPI_PACK_BLOCKS"
"""0: keep packable matrices (block_kernels.PACKABLE) in the file's layout under auto
(benchmarks compare the two)."""


def has_hardware_bf16() -> bool:
    """This CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles)."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)()
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def candidate_paths() -> tuple[str, ...]:
    """The paths a plan chooses among on this CPU (int8 panels where the kernel has them, bf16
    only where it runs in hardware)."""
    fast_bf16 = has_hardware_bf16() and has_onednn_bf16()
    kernels = block_kernels()
    panels = ("int8_panels",) if kernels is not None and kernels.has_panels else ()
    return ("int8",) + panels + ("dense",) + (("dense_bf16",) if fast_bf16 else ())


class PathPlanner:
    """Plans per (weight type, shape): from the cache file, checked at this start, or measured
    (path_plan.settle_plan); a measured plan is kept in the file only where the host was quiet
    while it was measured (kernel_records.BusyProbe), with its thread count and CPU."""

    def __init__(self, kernels: BlockKernels, scratch: TileScratch, cache: PlanCache | None,
                 batch_invariant: bool = False) -> None:
        """batch_invariant: choose among the int8 family only (int8, int8_panels: a row's bits
        the same at every row count), never a dense GEMM whose sums differ from theirs."""
        self.kernels, self.scratch, self.cache = kernels, scratch, cache
        self.paths = tuple(p for p in candidate_paths() if not batch_invariant or p in INT8_FAMILY)
        self.plans: dict[tuple[str, tuple[int, int]], PathPlan] = {}
        self.measured = 0
        self._source = plan_kernel_source()
        self._digest = plan_source_digest(self._source)

    def plan_for(self, matrix: BlockMatrix) -> PathPlan:
        memo = (_form_name(matrix), matrix.shape)
        if memo not in self.plans:
            self.plans[memo] = self._settled(matrix)
        return self.plans[memo]

    def _settled(self, matrix: BlockMatrix) -> PathPlan:
        name = _form_name(matrix)
        key = PlanCache.key(cpu_id(), self._source, name, matrix.shape, self.paths)
        record = self.cache.get(key) if self.cache else None
        probe = BusyProbe().start()
        probe_linear = BlockLinear(matrix, self.kernels, PathPlan.only("dense"), self.scratch)
        settled = settle_plan(record.plan if record else None, PathTimer(probe_linear.run, matrix.shape[1], self.paths))
        busy = probe.share()
        what = f"weights {name} {matrix.shape[0]}x{matrix.shape[1]}"
        if settled.how == "checked":
            if self.cache is not None and record is not None and record.source != self._digest:
                # kept before records named their kernel source: its key says it is this one's
                self.cache.put(key, dataclasses.replace(record, source=self._digest))
            logger.info("%s: %s (cached; checked at %s rows)", what, settled.plan.describe(),
                        " and ".join(map(str, CHECK_ROWS)))
            return settled.plan
        self.measured += 1
        kept = self.cache is not None and busy <= QUIET_SHARE
        if self.cache is not None and kept:
            self.cache.put(key, PlanRecord(settled.plan, name, matrix.shape, torch.get_num_threads(),
                                           cpu_name(), time.time(), busy, self._digest))
        elif self.cache is not None and record is not None:
            self.cache.drop(key)  # it lost its check: the next start measures afresh
        logger.info("%s: %s (%s%s; other processes used %.0f%% of the CPUs%s)", what, settled.plan.describe(),
                    settled.how, " the cached plan, which lost its check" if settled.how == "replaced" else "",
                    busy * 100, "" if kept else ": for this run only")
        return settled.plan


def _form_name(matrix: BlockMatrix) -> str:
    """The type's name, marked where the blocks are packed (their own plans: other kernels)."""
    return f"{matrix.type_name} packed" if matrix.packed else matrix.type_name


class WeightPaths:
    """The linear factory of DecoderModel for one mode (`paths(weight)` -> the weight's linear),
    and the loader's choice of form per type (`paths.form(qtype)`). `plan` forces one plan for
    every block matrix (tests, benchmarks); otherwise plans are measured (PathPlanner)."""

    def __init__(self, mode: str, device: str | torch.device = "cpu", plan: PathPlan | None = None,
                 cache: PlanCache | None = None, device_blocks: bool | None = None,
                 dtype: torch.dtype = torch.bfloat16, batch_invariant: bool = False) -> None:
        """device_blocks: keep `auto`'s blocks for the Triton kernels (device_linear.py); None:
        on a CUDA device with Triton, or where JUSTAPI_DEVICE_BLOCKS=1 (True on a CPU runs
        them in Triton's interpreter: tests, and the GPU check's dry run). dtype: the compute
        dtype those kernels take. batch_invariant: auto's plans keep to the int8 family
        (`--batch-invariant`; fp32 and bf16 are oneDNN's, a row alike at every row count)."""
        if mode not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {mode!r}")
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        if device_blocks is None:
            on_gpu = self.device.type == "cuda" and torch.cuda.is_available()
            device_blocks = ((on_gpu or (on_cpu and os.environ.get("JUSTAPI_DEVICE_BLOCKS") == "1"))
                             and mode == "auto" and importlib.util.find_spec("triton") is not None)
        self.device_blocks = device_blocks and mode == "auto"
        self.scratch_device = _device_scratch(self.device) if self.device_blocks else None
        self.compute_dtype = dtype
        self.kernels = block_kernels() if on_cpu and mode in ("q4", "auto") and not self.device_blocks else None
        if self.device_blocks:
            logger.info("--weights auto on %s: GGUF blocks kept in its memory", self.device)
        elif mode == "q4":
            require_int4_kernel(self.device)
        elif mode == "auto" and self.kernels is None:  # a GPU, or no C compiler
            logger.info("no block kernels on %s: --weights auto runs fp32", self.device)
            mode = "fp32"
        elif mode == "auto" and plan is None and self.kernels is not None and not self.kernels.has_panels:
            # without AVX2 the block kernels build neither the int8 panels nor the direct path,
            # the two that put auto ahead of fp32 past a few rows
            logger.info("this CPU has no AVX2: --weights auto runs fp32, the fastest path here")
            self.kernels, mode = None, "fp32"
        elif mode == "bf16" and on_cpu and not (has_hardware_bf16() and has_onednn_bf16()):
            logger.warning("this CPU has no bf16 matmul instructions (AVX512-BF16 or AMX): "
                           "--weights bf16 runs fp32, which is faster here")
            mode = "fp32"
        elif mode == "bf16" and not on_cpu:
            mode = "fp32"  # the GPU forward computes in bf16 already
        self.mode = mode
        self.scratch = TileScratch()
        self.packed = 0
        """Matrices packed (a copy each: the file's layout is freed with the loader's weights)."""
        self.forced_plan = plan
        self.planner = (PathPlanner(self.kernels, self.scratch, cache if cache else _default_cache(),
                                    batch_invariant)
                        if self.kernels is not None and plan is None else None)

    @property
    def keeps_quantized(self) -> bool:
        return self.mode in ("q4", "auto")

    def form(self, qtype: GGMLQuantizationType) -> str:
        """How the loader keeps a matrix of `qtype`: "dense", "planes" or "blocks"."""
        if self.device_blocks:
            from workers.weights.device_linear import device_kernels_work  # imports Triton

            return "blocks" if device_kernels_work(qtype, self.device, self.compute_dtype) else "dense"
        if self.mode == "q4" and is_quantizable(qtype):
            return "planes"
        if self.mode in ("q4", "auto") and self.kernels is not None and is_block_type(qtype):
            return "blocks"
        return "dense"

    def __call__(self, weight: Matrix) -> LinearLike:
        if isinstance(weight, RowStack):
            return StackLinear([self(part) for part in weight.parts])
        if isinstance(weight, BlockMatrix) and self.mode == "q4" and is_quantizable(weight.qtype):
            weight = planes_of(weight)
        if isinstance(weight, QuantMatrix) and self.mode == "q4":
            return Int4Linear(weight, self.device)
        if isinstance(weight, BlockMatrix) and self.scratch_device is not None:
            from workers.weights.device_linear import DeviceBlockLinear

            return DeviceBlockLinear(weight, self.scratch_device, self.compute_dtype)
        if isinstance(weight, BlockMatrix) and self.kernels is not None:
            if os.environ.get(PACK_ENV, "1") != "0":
                packed = packed_copy(weight, self.kernels)  # block_kernels.PACKABLE: rows interleaved by 8 (kquant_packed.h)
                self.packed += packed is not weight
                weight = packed
            plan = self.forced_plan or self.planner.plan_for(weight)  # type: ignore[union-attr]
            return BlockLinear(weight, self.kernels, plan, self.scratch)
        return Linear(weight, torch.bfloat16 if self.mode == "bf16" else None)


def _device_scratch(device: torch.device) -> Any:
    from workers.weights.device_linear import DeviceScratch  # imports Triton: device blocks only

    return DeviceScratch(device)


def _default_cache() -> PlanCache | None:
    try:
        return PlanCache(cache_dir() / PLANS_FILE)
    except KernelBuildError:
        return None


def load_model(gguf: GGUFFile, device: str = "cpu", dtype: torch.dtype = torch.float32,
               weights: str = "fp32", progress: bool = True, plan: PathPlan | None = None,
               allow_unused_tensors: bool = False,
               device_blocks: bool | None = None, batch_invariant: bool = False) -> DecoderModel:
    """The model of a GGUF file with the weights kept and computed as `weights` says (a file
    with tensors the loader does not read is refused unless `allow_unused_tensors`;
    device_blocks, batch_invariant: WeightPaths')."""
    paths = WeightPaths(weights, device, plan, device_blocks=device_blocks, dtype=dtype,
                        batch_invariant=batch_invariant)
    check_weight_types(gguf, paths.mode if paths.kernels is not None else "fp32", str(paths.device))
    loaded = load_weights(gguf, device, dtype, progress, keep_quantized=paths.form,
                          allow_unused_tensors=allow_unused_tensors)
    model = DecoderModel(loaded, paths)
    del loaded  # the file's layout of every matrix the model keeps packed
    model.layer_chain = LayerChain.of(model)
    if paths.packed or (paths.planner is not None and paths.planner.measured):
        release_freed_memory()  # what the plans were timed with, the blocks packed copies replaced
    return model

