"""Where an in-process decode step's time goes, part by part (CPU, or any device eagerly).

    python -m tools.bench step-parts --weights auto --batches 1,4 --steps 24

Each part of the forward is wrapped with a wall-clock timer: the layers' matmuls, the output
head (its norm and matmul), the KV write, attention, the norms (the residual adds fused
with them), rotary, the FFN's activation; the rest of the forward (embedding, views, adds)
is what the forward took beyond them, and the runner's share (the plan to tensors, the
logits' rows, sampling) is the step beyond the forward. The timers cost ~1 us per call, so
the small parts read a little high. The parts are the Python layer loop's: the layer chain
(workers/model/cpu_layer_chain.py), which makes the same calls from one C call, is off here.
Figures are medians over the steps, per step and per call. Owns: the wrapping and the table. Does not own: the parts (workers/model/).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch

from justapi.model.gguf_file import default_model_path
from tools.bench.engine import run_steps
from workers.engine import LLMEngine
from workers.model import forward as forward_module
from workers.model import ffn as ffn_module

PARTS = ["matmuls (layers)", "head (norm + matmul)", "attention", "KV write", "norms", "rotary",
         "activation", "rest of the forward", "runner and sampler"]


class Timers:
    """Seconds and calls per part within the current step; each step's totals kept."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []
        self.step_calls: list[dict[str, int]] = []
        self.depth = 0  # nested timed calls count once, in the outermost part

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[part] += time.perf_counter() - start
                self.calls[part] += 1
                self.depth -= 1
        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.now))
        self.step_calls.append(dict(self.calls))
        self.now.clear()
        self.calls.clear()


def instrument(engine: LLMEngine, timers: Timers) -> None:
    """Wrap the engine's forward parts in place (this process only). The layer chain is turned
    off: it makes the same calls from C, where they cannot be timed one by one."""
    model = engine.model
    model.layer_chain = None
    for layer in model.layers:
        for owner in [layer] + (getattr(layer.ffn, "experts", None) or [layer.ffn]):
            for name in ("qkv", "attn_out", "gate_up", "down"):
                if hasattr(owner, name):  # setattr: the wrapper stands in for the linear
                    setattr(owner, name, timers.wrap("matmuls (layers)", getattr(owner, name)))
    setattr(model, "logits", timers.wrap("head (norm + matmul)", model.logits))
    backend = engine.runner.backend
    setattr(backend, "attend", timers.wrap("attention", backend.attend))
    setattr(backend, "write_kv", timers.wrap("KV write", backend.write_kv))
    forward_module.add_rms_norm = timers.wrap("norms", forward_module.add_rms_norm)
    forward_module.rms_norm = timers.wrap("norms", forward_module.rms_norm)
    forward_module.apply_rotary = timers.wrap("rotary", forward_module.apply_rotary)
    original_ops_for = ffn_module.ops_for

    def ops_for(device: torch.device) -> Any:  # the activation: the FFN's one call on its ops
        ops = original_ops_for(device)
        if ops is None:
            return None
        wrapped = type("TimedOps", (), {})()
        wrapped.act_mul = timers.wrap("activation", ops.act_mul)
        return wrapped
    ffn_module.ops_for = ops_for
    model_forward = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = model_forward(*args, **kwargs)
        timers.now["forward"] += time.perf_counter() - start
        return out
    setattr(model, "forward", forward)


def measure(engine: LLMEngine, timers: Timers, batch: int, steps: int,
            prompt_tokens: int) -> tuple[dict[str, float], dict[str, int]]:
    """Median seconds per step of each part (and of the whole step) over `steps` decode steps,
    and each part's calls in a decode step."""
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, engine.model.params.vocab_size, prompt_tokens).tolist() for _ in range(batch)]
    run_steps(engine, prompts, 2)  # warm
    timers.steps.clear()
    timers.step_calls.clear()
    timers.now.clear()
    timers.calls.clear()
    runner_execute = engine.runner.execute
    totals: list[float] = []

    def execute(plan: Any) -> Any:
        start = time.perf_counter()
        result = runner_execute(plan)
        totals.append(time.perf_counter() - start)
        timers.end_step()
        return result
    engine.runner.execute = execute  # type: ignore[method-assign]
    try:
        run_steps(engine, prompts, steps)
    finally:
        engine.runner.execute = runner_execute  # type: ignore[method-assign]
    decode = [(total, parts) for total, parts in zip(totals[1:-1], timers.steps[1:-1])]  # not prefill, not the release
    rows: dict[str, list[float]] = defaultdict(list)
    for total, parts in decode:
        timed = sum(parts.get(p, 0.0) for p in PARTS[:7])
        head = parts.get("head (norm + matmul)", 0.0)
        forward_s = parts.get("forward", 0.0)
        for part in PARTS[:7]:
            rows[part].append(parts.get(part, 0.0))
        rows["rest of the forward"].append(forward_s - (timed - head))
        rows["runner and sampler"].append(total - forward_s - head)
        rows["step"].append(total)
    return {part: statistics.median(values) for part, values in rows.items()}, timers.step_calls[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench step-parts", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default SmolLM2-135M-Instruct)")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, float32 or bfloat16 (as justapi serve's)")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    need = max(batches) * -(-(args.prompt_tokens + args.steps + 8) // 16) + 16
    engine = LLMEngine(args.model or default_model_path(), num_blocks=need, max_seqs=max(batches),
                       progress=False, weights=args.weights, kv_cache_dtype=args.kv_cache_dtype)
    timers = Timers()
    instrument(engine, timers)
    print(f"weights {args.weights}, KV {engine.pool.tensor.dtype}, torch threads {torch.get_num_threads()}, "
          f"prompts of {args.prompt_tokens} "
          f"tokens, median of {args.steps - 2} decode steps; ms per step (calls per step)")
    with torch.inference_mode():
        for batch in batches:
            medians, calls = measure(engine, timers, batch, args.steps, args.prompt_tokens)
            print(f"\nbatch {batch}: step {medians['step'] * 1e3:.2f} ms")
            for part in PARTS:
                share = medians[part] / medians["step"]
                count = f" ({calls[part]})" if part in calls else ""
                print(f"  {part:<22} {medians[part] * 1e3:7.2f} ms {share:6.1%}{count}")
    engine.close()
