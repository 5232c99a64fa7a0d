"""The torch side of `python -m tools.bench gpu` (gpu.py): the copy bandwidth, and one model's
decode steps in each mode, in turns.
Owns: the measurements. Does not own: the flags or the report (gpu.py).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from justapi.model.gguf_file import GGUFError, default_model_path
from tools.bench.engine import best_window_s, run_steps
from tools.bench.gpu import MODES, SMOLLM2_SHAPE
from workers.engine import LLMEngine
from workers.model.attention import AttentionBackend, CudaBackend, TorchPagedBackend
from workers.model.cuda_graphs import build_step_graphs
from workers.model.paged_backend import TritonPagedBackend, triton_backend
from workers.model.step_graphs import GraphKey, StepGraphs, bucket_for


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a device-to-device copy (2 GiB; 64 MiB on a CPU)."""
    size = (64 << 20) if device == "cpu" else (2 << 30)
    src = torch.randn(size // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times[2:])


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(torch.device(device))


def resolve(model: str) -> tuple[str, str]:
    """(what to load, its label): 'smollm2' is the embedded GGUF, else its shape, synthetic."""
    if model != "smollm2":
        return model, model.removeprefix("synthetic:")[:48]
    try:
        return default_model_path(), "SmolLM2-135M (GGUF, bf16 on the GPU)"
    except GGUFError:
        return SMOLLM2_SHAPE, "SmolLM2-135M shape (synthetic, bf16)"


def modes(engine: LLMEngine, device: str) -> dict[str, tuple[AttentionBackend, StepGraphs | None]]:
    """Each mode's (backend, graphs) for the engine's runner."""
    p, bs = engine.model.params, engine.pool.shape.block_size
    runner_backend = engine.runner.backend  # a GPU engine's: Triton, graphs captured (engine.graphs)
    paged = (runner_backend if isinstance(runner_backend, TritonPagedBackend)  # else a CPU dry
             else triton_backend(device, bs, p.num_heads, p.num_kv_heads, p.head_dim))  # run
    if paged is None:
        raise SystemExit("python -m tools.bench gpu: Triton is not installed")
    max_seqs = engine.limits.max_seqs
    graphed = engine.graphs or build_step_graphs(engine.model, engine.pool, paged, max_seqs,
                                                 engine.max_context)
    eager = build_step_graphs(engine.model, engine.pool, paged, max_seqs, engine.max_context,
                              use_cuda_graphs=False)
    gathered = CudaBackend(bs, device) if device != "cpu" else TorchPagedBackend(bs, chunk_bytes=None)
    return {"graphs": (paged, graphed), "eager": (paged, eager), "gathered": (gathered, None)}


def replay_ms(graphs: StepGraphs, batch: int, device: str, repeats: int = 50) -> float:
    """Median ms of replaying the batch's decode graph alone (over the inputs its last step left):
    the device's share of a step; the rest of a step is the host's (plan, copy-in, sampling)."""
    bucket = bucket_for(batch, graphs.buckets)
    step = graphs.graphs.get(GraphKey(bucket, 1)) if bucket is not None else None
    if step is None:
        return float("nan")
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 3):
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def kernel_times(graphs: StepGraphs, device: str, replays: int = 20, top: int = 12) -> list[dict[str, Any]]:
    """The kernels of the batch-1 decode graph, by device time per replay (torch's profiler
    over `replays` replays): which of them the step's time goes to."""
    from torch.profiler import ProfilerActivity, profile
    step = graphs.graphs.get(GraphKey(1, 1))
    if step is None or device == "cpu":
        return []
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                step()
            _sync(device)
    except RuntimeError as exc:  # no profiler here: the figures above still stand
        print(f"    (no kernel profile: {exc})", flush=True)
        return []
    rows = [{"name": e.key, "calls": e.count // replays, "ms": e.device_time_total / 1e3 / replays}
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return [{"name": "(all kernels)", "calls": sum(r["calls"] for r in rows), "ms": total}] + rows[:top]


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of the matrices one decode step streams: every layer's and the output head."""
    p = engine.model.params
    per_layer = p.hidden_size * (p.q_size + 2 * p.kv_size) + p.q_size * p.hidden_size + 3 * p.ffn_size * p.hidden_size
    element = torch.empty(0, dtype=engine.model.dtype).element_size()
    return element * (p.num_layers * per_layer + p.vocab_size * p.hidden_size)


def measure_model(model: str, args: argparse.Namespace, copy_bytes_per_s: float) -> dict[str, Any]:
    path, name = resolve(model)
    batches, steps = args.batches, args.decode_steps
    need = max(batches) * -(-(args.prompt_tokens + steps * 3 + 8) // 16) + 16
    start = time.perf_counter()
    engine = LLMEngine(path, device=args.device, num_blocks=need, max_seqs=max(batches), progress=False)
    load_s = time.perf_counter() - start
    paths = modes(engine, args.device)
    graphs = paths["graphs"][1]
    capture = graphs.report.line() if graphs is not None and graphs.report else "no graphs"
    print(f"{name}: loaded in {load_s:.1f} s; {capture}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        prompts = [rng.integers(0, engine.model.params.vocab_size, args.prompt_tokens).tolist()
                   for _ in range(batch)]
        rows.append({"batch": batch, **decode_in_turns(engine, paths, prompts, steps, args.rounds)})
        if graphs is not None:
            rows[-1]["replay_ms"] = replay_ms(graphs, batch, args.device)
        print(f"  batch {batch}: " + ", ".join(f"{m} {rows[-1][m]['median_step_ms']:.3f} ms" for m in MODES)
              + (f" (the graph's replay alone {rows[-1]['replay_ms']:.3f} ms)" if "replay_ms" in rows[-1] else ""),
              flush=True)
    out: dict[str, Any] = {"name": name, "load_s": load_s, "graph_capture": capture,
                           "weight_bytes": weight_bytes(engine), "decode": rows}
    if args.profile and graphs is not None:
        out["batch1_kernels"] = kernel_times(graphs, args.device)
        print("\n".join(f"    {k['ms']:7.3f} ms {k['calls']:5d} x {k['name'][:90]}" for k in out["batch1_kernels"]),
              flush=True)
    if 1 in batches:
        step_s = next(r for r in rows if r["batch"] == 1)["graphs"]["median_step_ms"] / 1e3
        out["batch1_bandwidth_share"] = out["weight_bytes"] / step_s / copy_bytes_per_s
    engine.close()
    return out


def decode_in_turns(engine: LLMEngine, paths: dict[str, tuple[AttentionBackend, StepGraphs | None]],
                    prompts: list[list[int]], steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Each mode's decode step times over `rounds` turns (order alternating), after a warm-up."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for turn in range(rounds + 1):
        for mode in MODES if turn % 2 == 0 else MODES[::-1]:
            engine.runner.backend, engine.runner.graphs = paths[mode]
            step_s = run_steps(engine, prompts, steps)[1]
            if turn:  # turn 0 warms every mode up (compiles, allocator)
                times[mode] += step_s
    batch = len(prompts)
    return {mode: {"median_step_ms": statistics.median(t) * 1e3,
                   "tok_per_s": batch / statistics.median(t),
                   "best_window_tok_per_s": batch / best_window_s(t)} for mode, t in times.items()}
