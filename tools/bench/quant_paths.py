"""Per-matmul timings behind `--weights auto` (used by `python -m tools.bench quant`).

- `path_tables`: for every (weight type, shape) of a model, each path's median time at the
  plan's row counts, measured as the worker does at start-up (in turns), with torch's int4
  kernel beside them where the type has exact 4-bit planes (what `--weights q4` runs), the
  fitted lines and the plan.
- `int8_step`: the first step toward llama.cpp's decode speed (int8 activations times the
  weights' integer codes): one decode step's matmuls (every layer, the head) on each kernel at
  1, 2 and 4 rows, in turns, for this model's types.
Owns: these two tables. Does not own: the paths (workers/weights/).
"""
from __future__ import annotations

import ctypes
import functools
import os
import statistics
from typing import Callable

import torch

from justapi.model.gguf_file import GGUFFile
from workers.model.cpu_kernels import build
from workers.model.forward import Linear, DecoderModel
from workers.weights.block_kernels import BlockKernels
from workers.weights.block_linear import BlockLinear, StackLinear
from workers.weights.path_plan import MEASURE_ROWS, PathPlan, fit_line, paired_times, plan_from_timings
from workers.weights.paths import PACK_ENV, candidate_paths, load_model
from workers.weights.quant_blocks import is_quantizable, planes_of
from workers.weights.quant_linear import Int4Linear, has_int4_kernel


def block_linears(model: DecoderModel) -> list[BlockLinear]:
    """Every BlockLinear of the model (parts of stacks included), layers first, then the head."""
    out: list[BlockLinear] = []
    for linear in [lin for layer in model.layers for lin in layer.linears()] + [model.output]:
        parts = linear.parts if isinstance(linear, StackLinear) else [linear]
        out += [p for p in parts if isinstance(p, BlockLinear)]
    return out


def load_blocks(model_path: str) -> DecoderModel:
    """The model under auto with one fixed plan (nothing measured at load)."""
    return load_model(GGUFFile(model_path), weights="auto", progress=False, plan=PathPlan.only("int8"))


def distinct_shapes(model: DecoderModel) -> dict[tuple[str, tuple[int, int]], BlockLinear]:
    shapes: dict[tuple[str, tuple[int, int]], BlockLinear] = {}
    for linear in block_linears(model):
        shapes.setdefault((linear.matrix.type_name, linear.matrix.shape), linear)
    return shapes


def runners(linear: BlockLinear) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each candidate path of one matrix, plus torch's int4 kernel where the type has planes."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        path: functools.partial(linear.run, path) for path in candidate_paths()}
    if is_quantizable(linear.matrix.qtype) and has_int4_kernel(torch.device("cpu")):
        out["int4 (q4)"] = Int4Linear(planes_of(linear.matrix))
    return out


def path_tables(model_path: str, repeats: int) -> dict[tuple[str, tuple[int, int]], PathPlan]:
    """Print each (type, shape)'s table and plan; return the plans."""
    plans = {}
    for (type_name, shape), linear in distinct_shapes(load_blocks(model_path)).items():
        calls = runners(linear)
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        with torch.inference_mode():
            for rows in MEASURE_ROWS:
                x = torch.randn(rows, shape[1])
                medians = paired_times({name: functools.partial(f, x) for name, f in calls.items()}, repeats,
                                       reduce=statistics.median)
                for name in calls:
                    seconds[name].append(medians[name])
        plan = plan_from_timings(MEASURE_ROWS, {p: seconds[p] for p in candidate_paths()})
        plans[(type_name, shape)] = plan
        print(f"\n{type_name} {shape[0]}x{shape[1]} (out x in): median ms per call, in turns")
        print(f"{'rows':>5} | " + " ".join(f"{name:>11}" for name in calls))
        for i, rows in enumerate(MEASURE_ROWS):
            print(f"{rows:>5} | " + " ".join(f"{seconds[name][i] * 1e3:11.3f}" for name in calls))
        fits = ", ".join(f"{p} {a * 1e3:.3f} + {b * 1e3:.4f}/row" for p, (a, b) in
                         ((p, fit_line(MEASURE_ROWS, seconds[p])) for p in candidate_paths()))
        print(f"fitted ms: {fits}\nplan: {plan.describe()}")
    return plans


def int8_step(model_path: str, repeats: int, rows_list: tuple[int, ...] = (1, 2, 4),
              only: tuple[str, ...] = ()) -> None:
    """One decode step's matmuls on each kernel, in turns: auto's paths (int8, int8_panels,
    tile: expanded into the scratch buffer, then GEMM), the int8 path with every type on its
    coded tiles (a build without the direct path that Q4_0/Q4_1/Q8_0/K-quants take at 1-4 rows), an
    fp32 copy (what --weights fp32 multiplies) and torch's int4 kernel (q4) where the types
    allow; where the model has packed matrices (Q4_K, Q6_K), the int8 path on the file's layout
    too (a second copy loaded with JUSTAPI_PACK_BLOCKS=0). `only`: these columns alone."""
    model = load_blocks(model_path)
    linears = block_linears(model)
    plain: list[BlockLinear] = []
    if any(lin.matrix.packed for lin in linears):
        os.environ[PACK_ENV] = "0"
        try:
            plain = block_linears(load_blocks(model_path))
        finally:
            del os.environ[PACK_ENV]
    dense = [Linear(lin.matrix) for lin in linears] if not only or "dense fp32 copy" in only else []
    quant_ok = all(is_quantizable(lin.matrix.qtype) for lin in linears) and has_int4_kernel(torch.device("cpu")) \
        and (not only or "int4 (q4)" in only)
    int4 = [Int4Linear(planes_of(lin.matrix)) for lin in linears] if quant_ok else []
    weight_mib = sum(lin.matrix.num_bytes for lin in linears) / 2**20
    print(f"\none decode step's matmuls ({len(linears)} of them, {weight_mib:.0f} MiB of blocks), "
          f"median ms in turns (types: {sorted({lin.matrix.type_name for lin in linears})})")
    coded = BlockKernels(ctypes.CDLL(str(build("quant_matmul", ("-DDIRECT_ROWS=0",)))))
    names = (["int8"] + (["int8 file layout"] if plain else []) + ["int8 coded", "int8_panels"]
             + (["panels file layout"] if plain else []) + ["tile", "dense fp32 copy"]
             + (["int4 (q4)"] if int4 else []))
    names = [name for name in names if not only or name in only]
    print(f"{'rows':>5} | " + " ".join(f"{name:>15}" for name in names) + f" | GB/s of blocks ({names[0]})")
    with torch.inference_mode():
        for rows in rows_list:
            xs = [torch.randn(rows, lin.in_features) for lin in linears]
            calls = {"int8": lambda: [lin.run("int8", x) for lin, x in zip(linears, xs)],
                     "int8 coded": lambda: [coded.matmul(lin.matrix, x) for lin, x in zip(linears, xs)],
                     "int8_panels": lambda: [lin.run("int8_panels", x) for lin, x in zip(linears, xs)],
                     "tile": lambda: [lin.run("dense", x) for lin, x in zip(linears, xs)],
                     "dense fp32 copy": lambda: [d(x) for d, x in zip(dense, xs)]}
            if plain:
                calls["int8 file layout"] = lambda: [lin.run("int8", x) for lin, x in zip(plain, xs)]
                calls["panels file layout"] = lambda: [lin.run("int8_panels", x) for lin, x in zip(plain, xs)]
            if int4:
                calls["int4 (q4)"] = lambda: [q(x) for q, x in zip(int4, xs)]
            medians = paired_times({name: calls[name] for name in names}, repeats, reduce=statistics.median)
            rate = weight_mib * 2**20 / medians[names[0]] / 1e9
            print(f"{rows:>5} | " + " ".join(f"{medians[n] * 1e3:15.2f}" for n in names) + f" | {rate:.1f}")

