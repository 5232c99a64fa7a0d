"""Speculative decoding on this machine: decode tokens/s with and without it, on SmolLM2.

Sections (all by default):
  ngram   batch 1, input-grounded tasks (copy / rewrite a passage the prompt holds): plain
          decoding vs --spec ngram, decode tokens/s and the speed-up;
  tree    chains vs token trees at the same verification budget (n-gram): mean acceptance
          length and tokens/s side by side;
  draft   draft models at batch 1: SmolLM2 as its own draft, and a random draft (almost never
          right) with the adaptive rule off and on;
  sweep   batch sizes: plain, fixed gamma and the adaptive rule - where speculation stops
          paying and whether the rule follows.
Every run goes through the real scheduler core and ModelRunner (workers/engine_loop.py), one
model load for all. Decode tokens/s = (tokens - batch) / (time - time of a 1-token run), best
of --repeats. On a machine shared with other jobs, wall time swings with their load; with
--threads 1 the process's CPU time is the work done, so `--clock cpu` (the default) gives
figures that hold still (it counts everything this process does: Python, sampling, the
scheduler, the draft model).

    python -m tools.bench spec [--threads 1] [--section ngram,tree,draft,sweep] [--max-tokens 96]
    python -m tools.bench spec --section sweep --weights auto    # the server's default path
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from justapi.config.spec import SpecConfig
from justapi.model.gguf_file import GGUFFile, default_model_path
from justapi.sampling import SamplingParams
from workers.engine import LLMEngine
from workers.engine_loop import SchedulerLoop
from workers.kv.pool import KVPool, PoolShape
from workers.model.backends import make_backend
from workers.model.forward import DecoderModel
from workers.spec.draft import DraftModel
from workers.spec.draft_gguf import write_random_draft, write_truncated_draft
from workers.weights.paths import load_model

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens, and wrote the weather in a small leather book. On clear nights he "
    "could see the lights of the fishing boats far out on the water, and he counted them before "
    "he slept.",
    "Our village market opens at seven on Saturdays. Farmers bring apples, pears, fresh bread and "
    "honey from the hills. By nine the square is crowded with families, and the baker usually "
    "sells out of cinnamon rolls before the church bell rings at ten.",
    "To plant a tomato seedling, dig a hole twice as deep as the pot, loosen the roots gently, and "
    "set the plant low so that the lower stem is buried. Water it well, add a stake for support, "
    "and keep the soil moist but not wet during the first two weeks.",
    "The train left the station a few minutes late. Outside the window the city gave way to "
    "fields, then to forests, and finally to a long grey coastline. Most passengers slept, but a "
    "little girl kept her face pressed to the glass, waiting for the sea.",
]
TASKS = {
    "copy": "Repeat the following passage word for word:\n\n{}",
    "rewrite": "Rewrite the following passage in the present tense:\n\n{}",
    "list": "Here is a list: red apple, red car, red house, blue apple, blue car, blue house, "
            "green apple, green car. Continue the list with more colours in the same pattern.{}",
}


@dataclass
class Run:
    tokens: int
    decode_s: float  # CPU time of this process (see main's docstring), or wall time
    stats: dict

    @property
    def tok_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0


class Bench:
    def __init__(self, model: str, max_tokens: int, repeats: int, clock: str,
                 weights: str = "fp32") -> None:
        self.engine = LLMEngine(model, progress=False, num_blocks=4096, max_seqs=64,
                                weights=weights)
        self.max_tokens = max_tokens
        self.repeats = repeats
        self.clock = time.process_time if clock == "cpu" else time.perf_counter
        self._drafts: dict[str, DecoderModel] = {"self": self.engine.model}

    def prompts(self, task: str, batch: int) -> list[list[int]]:
        texts = [TASKS[task].format(PASSAGES[i % len(PASSAGES)] if task != "list" else "")
                 for i in range(batch)]
        return [self.engine.encode(self.engine.chat_prompt([{"role": "user", "content": t}]))
                for t in texts]

    def draft(self, name: str) -> DecoderModel:
        if name not in self._drafts:  # "random": a 1-layer random draft with the vocabulary;
            # "layers:N": the target's first N layers (workers/spec/draft_gguf.py)
            path = os.path.join(tempfile.mkdtemp(prefix="justapi-draft-"), "draft.gguf")
            if name == "random":
                write_random_draft(self.engine.path, path)
            else:
                write_truncated_draft(self.engine.path, path, int(name.split(":")[1]))
            self._drafts[name] = load_model(GGUFFile(path), progress=False)
        return self._drafts[name]

    def _loop(self, spec: SpecConfig, draft: str = "") -> SchedulerLoop:
        engine = self.engine
        engine.runner.draft = None
        if draft:
            model, shape = self.draft(draft), engine.pool.shape
            p = model.params
            pool = KVPool.create(PoolShape(p.num_layers, shape.num_blocks, shape.block_size,
                                           p.num_kv_heads, p.head_dim))
            engine.runner.draft = DraftModel(model, pool, make_backend("cpu", shape.block_size), spec)
        return SchedulerLoop(engine.runner, engine.loop_limits(), spec)

    def run(self, prompts: list[list[int]], spec: SpecConfig, draft: str = "") -> Run:
        """Best of `repeats`: decode time = a max_tokens run minus a 1-token run (prefill)."""
        best: Run | None = None
        for _ in range(self.repeats):
            prefill_s, _ = self._timed(prompts, spec, draft, 1)
            total_s, (tokens, stats) = self._timed(prompts, spec, draft, self.max_tokens)
            run = Run(tokens - len(prompts), max(total_s - prefill_s, 1e-9), stats)
            best = run if best is None or run.tok_s > best.tok_s else best
        assert best is not None
        return best

    def _timed(self, prompts: list[list[int]], spec: SpecConfig, draft: str,
               max_tokens: int) -> tuple[float, tuple[int, dict]]:
        loop = self._loop(spec, draft)
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(prompts)
        start = self.clock()
        with torch.inference_mode():
            outs = loop.generate(prompts, params)
        elapsed = self.clock() - start
        return elapsed, (sum(len(o.token_ids) for o in outs), loop.stats())


def acceptance(run: Run) -> str:
    s = run.stats
    if not s.get("spec_decode_num_drafts"):
        return f"{'-':>6s} {'-':>6s} {'-':>6s}"
    return (f"{s['spec_decode_mean_acceptance_length']:6.2f} "
            f"{s['spec_decode_draft_acceptance_rate']:6.2f} {s['spec_decode_mean_budget_levels']:6.2f}")


HEADER = f"{'':40s} {'tokens':>6s} {'tok/s':>7s} {'x':>5s} {'acclen':>6s} {'rate':>6s} {'levels':>6s}"


def row(label: str, run: Run, base: Run) -> str:
    return (f"{label:40s} {run.tokens:6d} {run.tok_s:7.1f} {run.tok_s / base.tok_s:5.2f} "
            f"{acceptance(run)}")


def compare(bench: Bench, task: str, runs: list[tuple[str, SpecConfig, str]]) -> None:
    """Batch 1 on `task`: a plain row, then one row per (label, spec, draft) against it."""
    prompts = bench.prompts(task, 1)
    base = bench.run(prompts, SpecConfig())
    print(row(f"{task}: plain", base, base))
    for label, spec, draft in runs:
        print(row(f"{task}: {label}", bench.run(prompts, spec, draft), base))


def section_ngram(bench: Bench) -> None:
    print("== batch 1, input-grounded tasks: plain vs --spec ngram (gamma 4, adaptive)")
    print(HEADER)
    for task in ("copy", "rewrite"):
        compare(bench, task, [("ngram gamma 4", SpecConfig(spec="ngram"), ""),
                              ("ngram gamma 8", SpecConfig(spec="ngram", gamma=8), "")])


def section_tree(bench: Bench) -> None:
    print("== chains vs trees at the same verification budget (n-gram, batch 1, adaptive off)")
    print(HEADER)
    shapes: list[tuple[str, dict[str, Any]]] = [("budget 4: chain 4", dict(gamma=4)), ("budget 4: tree 2,2", dict(spec_tree="2,2")),
              ("budget 8: chain 8", dict(gamma=8)), ("budget 8: tree 2x4", dict(gamma=4, branch=2)),
              ("budget 8: tree 4,1,1,1", dict(spec_tree="4,1,1,1", spec_budget=8))]
    for task in ("copy", "list"):
        compare(bench, task, [(label, SpecConfig(spec="ngram", spec_adaptive=False, **shape), "")
                              for label, shape in shapes])


def section_draft(bench: Bench) -> None:
    print("== draft models, batch 1 (adaptive off unless said)")
    print(HEADER)
    for task in ("rewrite", "copy"):
        runs: list[tuple[str, str, dict[str, Any]]] = [("self-draft chain 3", "self", dict(gamma=3)),
                ("first 24 layers: chain 4", "layers:24", dict(gamma=4)),
                ("first 24 layers: tree 2,2 (budget 4)", "layers:24", dict(spec_tree="2,2")),
                ("first 24 layers: chain 8", "layers:24", dict(gamma=8)),
                ("first 24 layers: tree 2x4 (budget 8)", "layers:24", dict(gamma=4, branch=2))]
        if task == "copy":
            runs = runs[:1] + [("random draft, gamma 4", "random", dict()),
                               ("random draft, adaptive", "random", dict(spec_adaptive=True))]
        compare(bench, task, [(label, SpecConfig(draft_model=draft,
                                                 **{"spec_adaptive": False, **fields}), draft)
                              for label, draft, fields in runs])


def section_sweep(bench: Bench, batches: list[int], task: str, gammas: list[int]) -> None:
    """Plain, fixed gamma (the first of gammas) and the adaptive rule at each of gammas."""
    print(f"== batch sweep, {task} task, n-gram: plain vs fixed gamma {gammas[0]} vs adaptive at "
          f"gamma {', '.join(map(str, gammas))}")
    print(f"{'batch':>5s} {'plain tok/s':>11s} {'fixed tok/s':>11s} {'x':>5s}" + "".join(
        f" {f'g{g} adaptive':>12s} {'x':>5s} {'levels':>6s} {'acclen':>6s}" for g in gammas))
    for batch in batches:
        prompts = bench.prompts(task, batch)
        base = bench.run(prompts, SpecConfig())
        fixed = bench.run(prompts, SpecConfig(spec="ngram", spec_adaptive=False, gamma=gammas[0]))
        line = f"{batch:5d} {base.tok_s:11.1f} {fixed.tok_s:11.1f} {fixed.tok_s / base.tok_s:5.2f}"
        for gamma in gammas:
            adaptive = bench.run(prompts, SpecConfig(spec="ngram", gamma=gamma))
            s = adaptive.stats
            line += (f" {adaptive.tok_s:12.1f} {adaptive.tok_s / base.tok_s:5.2f} "
                     f"{s.get('spec_decode_mean_budget_levels', 0.0):6.2f} "
                     f"{s.get('spec_decode_mean_acceptance_length', 0.0):6.2f}")
        print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench spec",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="target GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--section", default="ngram,tree,draft,sweep")
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--sweep-tasks", default="rewrite,copy")
    parser.add_argument("--gammas", default="4", help="sweep: the adaptive rule at each gamma "
                                                     "(the first also runs fixed)")
    parser.add_argument("--weights", default="fp32",
                        help="weight path: fp32 (LLMEngine's default) or auto (the server's)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: this process's CPU time (robust on a shared machine with "
                             "--threads 1); wall: elapsed time")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"model {args.model or default_model_path()}; torch threads {torch.get_num_threads()}; "
          f"{os.cpu_count()} cores; load average {load:.1f}; max_tokens {args.max_tokens}; "
          f"best of {args.repeats}; {args.clock} time; weights {args.weights}")
    bench = Bench(args.model, args.max_tokens, args.repeats, args.clock, args.weights)
    sections = args.section.split(",")
    if "ngram" in sections:
        section_ngram(bench)
    if "tree" in sections:
        section_tree(bench)
    if "draft" in sections:
        section_draft(bench)
    if "sweep" in sections:
        for task in args.sweep_tasks.split(","):
            section_sweep(bench, [int(b) for b in args.batches.split(",")], task,
                          [int(g) for g in args.gammas.split(",")])


if __name__ == "__main__":
    main()
