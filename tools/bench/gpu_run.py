"""The torch side of `python -m tools.bench gpu` (gpu.py): the copy bandwidth, and one model's
decode steps in each mode, in turns.
Owns: the measurements. Does not own: the flags or the report (gpu.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from justapi.model.gguf_file import GGUFError, default_model_path
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
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
    """(the GGUF file, its label): 'smollm2' is the embedded GGUF, else its shape and types,
    synthetic; a synthetic: spec is written once (the file is what is measured)."""
    from workers.weights.synthetic import materialize

    if model == "smollm2":
        try:
            return default_model_path(), "SmolLM2-135M (GGUF Q4_1)"
        except GGUFError:
            return materialize(SMOLLM2_SHAPE), "SmolLM2-135M shape (synthetic Q4_1)"
    if model.startswith("synthetic:"):
        return materialize(model), model.removeprefix("synthetic:")[:48]
    return model, os.path.basename(model)[:48]


def modes(engine: LLMEngine, device: str, wanted: tuple[str, ...] = MODES
          ) -> dict[str, tuple[AttentionBackend, StepGraphs | None]]:
    """Each wanted mode's (backend, graphs) for the engine's runner."""
    p, bs = engine.model.params, engine.pool.shape.block_size
    runner_backend = engine.runner.backend  # a GPU engine's: Triton, graphs captured (engine.graphs)
    paged = (runner_backend if isinstance(runner_backend, TritonPagedBackend)  # else a CPU dry
             else triton_backend(device, bs, p.num_heads, p.num_kv_heads, p.head_dim))  # run
    if paged is None:
        raise SystemExit("python -m tools.bench gpu: Triton is not installed")
    max_seqs = engine.limits.max_seqs
    # mixed steps' graphs too (mixed_graphs.py); a dry run's interpreter captures one small one
    tokens = engine.limits.max_batched_tokens if device != "cpu" else 32
    graphed = engine.graphs or build_step_graphs(engine.model, engine.pool, paged, max_seqs,
                                                 engine.max_context, max_tokens=tokens)
    out: dict[str, tuple[AttentionBackend, StepGraphs | None]] = {"graphs": (paged, graphed)}
    if "eager" in wanted:
        out["eager"] = (paged, build_step_graphs(engine.model, engine.pool, paged, max_seqs, engine.max_context,
                                                 use_cuda_graphs=False, max_tokens=tokens))
    if "gathered" in wanted:
        out["gathered"] = (CudaBackend(bs, device) if device != "cpu" else TorchPagedBackend(bs, chunk_bytes=None),
                           None)
    return out


def replay_ms(graphs: StepGraphs, batch: int, device: str, repeats: int = 50) -> float:
    """Median ms of replaying the batch's decode graph alone (over the inputs its last step left):
    the device's share of a step; the rest of a step is the host's (plan, copy-in, sampling)."""
    bucket = bucket_for(batch, graphs.buckets)
    step = graphs.graphs.get(GraphKey(bucket, 1)) if bucket is not None else None
    if step is None:
        return float("nan")
    times = []
    repeats = repeats if device != "cpu" else 1  # a dry run: the interpreter takes seconds a replay
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


def _linear_tensors(linear: Any) -> list[torch.Tensor]:
    """The tensors a linear reads: a dense weight, GGUF blocks, a stack's parts'."""
    if hasattr(linear, "parts"):
        return [t for part in linear.parts for t in _linear_tensors(part)]
    if hasattr(linear, "matrix"):
        return [linear.matrix.raw]
    return [linear.weight] if isinstance(getattr(linear, "weight", None), torch.Tensor) else []


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of the matrices one decode step streams, as the model keeps them (dense bf16, or
    the file's blocks): every layer's and the output head (of a MoE layer: one expert's)."""
    model = engine.model
    tensors = [t for layer in model.layers for linear in layer.linears(every_expert=False)
               for t in _linear_tensors(linear)] + _linear_tensors(model.output)
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_memory_bytes(engine: LLMEngine) -> int:
    """Device bytes of every weight the model keeps (shared storage counted once)."""
    model = engine.model
    tensors = [t for layer in model.layers for linear in layer.linears() for t in _linear_tensors(linear)]
    tensors += _linear_tensors(model.output) + [model.output_norm]
    embedding: Any = model.token_embd
    tensors += [t for t in (embedding, getattr(embedding, "raw", None)) if isinstance(t, torch.Tensor)]
    for layer in model.layers:
        tensors += [t for t in (layer.attn_norm, layer.ffn_norm, layer.qkv_bias) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def measure_model(model: str, args: argparse.Namespace, copy_bytes_per_s: float) -> dict[str, Any]:
    path, name = resolve(model)
    batches, steps = args.batches, args.decode_steps
    need = max(batches) * -(-(args.prompt_tokens + steps * 3 + 8) // 16) + 16
    start = time.perf_counter()
    if args.mixed_chunk:
        need += -(-args.mixed_chunk // 16) * 2
    engine = LLMEngine(path, device=args.device, num_blocks=need, max_seqs=max(batches), progress=False,
                       weights=args.weights)
    load_s = time.perf_counter() - start
    paths = modes(engine, args.device, args.modes)
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
        print(f"  batch {batch}: " + ", ".join(f"{m} {rows[-1][m]['median_step_ms']:.3f} ms" for m in paths)
              + (f" (the graph's replay alone {rows[-1]['replay_ms']:.3f} ms)" if "replay_ms" in rows[-1] else ""),
              flush=True)
    out: dict[str, Any] = {"name": name, "path": path, "weights": args.weights, "load_s": load_s,
                           "graph_capture": capture, "weight_bytes": weight_bytes(engine), "decode": rows,
                           "weight_memory_bytes": weight_memory_bytes(engine), "file_bytes": os.path.getsize(path)}
    if args.mixed_chunk:
        engine.runner.backend, engine.runner.graphs = paths["graphs"]
        batch = max([b for b in batches if b <= 64] or [min(batches)])
        prompts = [rng.integers(0, engine.model.params.vocab_size, args.prompt_tokens).tolist()
                   for _ in range(batch)]
        out["mixed"] = mixed_steps(engine, prompts, args.mixed_chunk, steps)
        print(f"  mixed: batch {batch} + {args.mixed_chunk}-token chunk {out['mixed']['mixed_ms']:.3f} ms, "
              f"uniform {out['mixed']['uniform_ms']:.3f} ms", flush=True)
    if args.profile and graphs is not None:
        out["batch1_kernels"] = kernel_times(graphs, args.device)
        print("\n".join(f"    {k['ms']:7.3f} ms {k['calls']:5d} x {k['name'][:90]}" for k in out["batch1_kernels"]),
              flush=True)
    if 1 in batches:
        step_s = next(r for r in rows if r["batch"] == 1)["graphs"]["median_step_ms"] / 1e3
        out["batch1_bandwidth_share"] = out["weight_bytes"] / step_s / copy_bytes_per_s
    engine.close()
    return out


def mixed_steps(engine: LLMEngine, prompts: list[list[int]], chunk: int, steps: int) -> dict[str, Any]:
    """Median step times of decoding `prompts` alone (uniform: replayed from its graph) and
    with a new `chunk`-token prompt beside them (mixed: eager unless mixed steps are graphed),
    alternating step by step."""
    runner, bs = engine.runner, engine.pool.shape.block_size
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 2, ignore_eos=True)
    ids = [f"mix-{i}" for i in range(len(prompts))]
    per_seq = -(-(max(map(len, prompts)) + 2 * steps + 2) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    extra = list(range(len(prompts) * per_seq, len(prompts) * per_seq + -(-chunk // bs)))
    new = [NewRequest(r, params, len(p), np.asarray(p, np.int32)) for r, p in zip(ids, prompts)]
    tokens = runner.execute(StepPlan.build(0, [(r, 0, p, t, True) for r, p, t in zip(ids, prompts, tables)],
                                           new)).sampled_token_ids
    lengths = [len(p) for p in prompts]
    times: dict[str, list[float]] = {"uniform": [], "mixed": []}
    rng = np.random.default_rng(1)
    for step in range(2 * steps):
        kind = "mixed" if step % 2 else "uniform"
        chunks = [(r, n + step, [int(t)], tab, True) for r, n, t, tab in zip(ids, lengths, tokens, tables)]
        added, done = [], [f"chunk-{step - 1}"] if step % 2 == 0 and step else []
        if kind == "mixed":
            prompt = rng.integers(0, engine.model.params.vocab_size, chunk).tolist()
            chunks.append((f"chunk-{step}", 0, prompt, extra, False))
            added = [NewRequest(f"chunk-{step}", params, chunk, np.asarray(prompt, np.int32))]
        start = time.perf_counter()
        result = runner.execute(StepPlan.build(1 + step, chunks, added, done))
        times[kind].append(time.perf_counter() - start)
        tokens = result.sampled_token_ids[:len(ids)]
    runner.execute(StepPlan.build(10**6, [], finished_request_ids=ids + [f"chunk-{2 * steps - 1}"]))
    uniform, mixed = (statistics.median(times[k][1:] or times[k]) * 1e3 for k in ("uniform", "mixed"))
    return {"batch": len(prompts), "chunk": chunk, "uniform_ms": uniform, "mixed_ms": mixed,
            "ratio": mixed / uniform}


def decode_in_turns(engine: LLMEngine, paths: dict[str, tuple[AttentionBackend, StepGraphs | None]],
                    prompts: list[list[int]], steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Each mode's decode step times over `rounds` turns (order alternating), after a warm-up."""
    names = list(paths)
    times: dict[str, list[float]] = {mode: [] for mode in names}
    for turn in range(rounds + 1):
        for mode in names if turn % 2 == 0 else names[::-1]:
            engine.runner.backend, engine.runner.graphs = paths[mode]
            step_s = run_steps(engine, prompts, steps)[1]
            if turn:  # turn 0 warms every mode up (compiles, allocator)
                times[mode] += step_s
    batch = len(prompts)
    return {mode: {"median_step_ms": statistics.median(t) * 1e3,
                   "tok_per_s": batch / statistics.median(t),
                   "best_window_tok_per_s": batch / best_window_s(t)} for mode, t in times.items()}
