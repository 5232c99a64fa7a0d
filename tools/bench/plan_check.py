"""What checking every plan against the pool and the model costs a step (workers/plan_check.py).

    python -m tools.bench plan-check --batches 1,16,64 --steps 200

Per batch size: decode steps through the in-process runner (SmolLM2 by default), the check
on and off in turns, step by step (A/B interleaved: what other processes do to the machine
falls on both alike), medians of each; and the check alone, the median of many calls on one
of those plans (the best round too: on a loaded host the median carries the load). The check's
share of a step is its median time alone over the median step with it.
Owns: that measurement. Does not own: the check.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from justapi.model.gguf_file import default_model_path
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from workers import runner as runner_module
from workers.engine import LLMEngine
from workers.plan_check import check_plan


def decode_ab(engine: LLMEngine, batch: int, steps: int, prompt_tokens: int) -> tuple[list[float], list[float], StepPlan]:
    """(seconds of the steps with the check, without it, the last plan) for `steps` decode steps
    of `batch` sequences after a prompt of prompt_tokens each; odd steps unchecked."""
    runner, bs = engine.runner, engine.pool.shape.block_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [f"ab-{i}" for i in range(batch)]
    per_seq = -(-(prompt_tokens + steps + 1) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompt = [(7 * j) % 1000 + 10 for j in range(prompt_tokens)]
    new = [NewRequest(r, params, prompt_tokens, np.asarray(prompt, np.int32)) for r in ids]
    tokens = runner.execute(StepPlan.build(0, [(r, 0, prompt, t, True) for r, t in zip(ids, tables)],
                                           new)).sampled_token_ids
    checked: list[float] = []
    unchecked: list[float] = []
    plan = StepPlan.build(0, [])
    for step in range(steps):
        plan = StepPlan.build(1 + step, [(r, prompt_tokens + step, [int(t)], tab, True)
                                         for r, t, tab in zip(ids, tokens, tables)])
        is_checked = step % 2 == 0
        runner_module.check_plan = check_plan if is_checked else _no_check  # type: ignore[assignment]
        start = time.perf_counter()
        tokens = runner.execute(plan).sampled_token_ids
        (checked if is_checked else unchecked).append(time.perf_counter() - start)
    runner_module.check_plan = check_plan  # type: ignore[assignment]
    runner.execute(StepPlan.build(10**6, [], finished_request_ids=ids))
    return checked, unchecked, plan


def _no_check(plan: StepPlan, limits: object) -> None:
    return None


def check_alone_s(engine: LLMEngine, plan: StepPlan, calls: int) -> tuple[float, float]:
    """(best, median) seconds of check_plan on `plan`, over rounds of 100 calls."""
    limits = engine.runner.limits
    rounds = []
    for _ in range(max(1, calls // 100)):
        start = time.perf_counter()
        for _ in range(100):
            check_plan(plan, limits)
        rounds.append((time.perf_counter() - start) / 100)
    return min(rounds), statistics.median(rounds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench plan-check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default SmolLM2-135M-Instruct)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per batch (half checked)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=20_000, help="check_plan calls timed alone")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(args.prompt_tokens + args.steps + 1) // 16)
    engine = LLMEngine(args.model or default_model_path(), num_blocks=max(batches) * per_seq + 16,
                       max_seqs=max(batches), progress=False)
    print(f"torch threads {torch.get_num_threads()}, prompts of {args.prompt_tokens} tokens, "
          f"{args.steps} decode steps a batch, the check on and off in turns")
    print(f"{'batch':>5} {'step checked':>13} {'unchecked':>10} {'difference':>11} "
          f"{'check alone: best':>18} {'median':>9} {'share':>7}")
    with torch.inference_mode():
        for batch in batches:
            checked, unchecked, plan = decode_ab(engine, batch, args.steps, args.prompt_tokens)
            on, off = statistics.median(checked), statistics.median(unchecked)
            best, median = check_alone_s(engine, plan, args.calls)
            print(f"{batch:>5} {on * 1e3:>10.3f} ms {off * 1e3:>7.3f} ms {(on - off) / off:>+10.2%} "
                  f"{best * 1e6:>15.1f} us {median * 1e6:>6.1f} us {median / on:>7.3%}")
    engine.close()
