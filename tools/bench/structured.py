"""Structured outputs on this machine: constrained vs free decoding on SmolLM2, grammar compile
times and the compile cache.

Sections (all by default):
  decode   batch 1 and 16, the same chat prompts asking for JSON: free decoding vs a small
           schema and a verbose one (long fixed keys), with forced tokens jumped over (the
           default) and without (masks only). Each free request emits exactly as many tokens
           as its constrained twin did (ignore_eos, max_tokens = that count), so the rows
           compare the same work. tok/s, ITL p50/p99 (time between a request's successive
           deliveries: a step that brings forced tokens delivers several at once), forced-token
           share, mask time per step (wall), cache hit ratio.
  compile  grammar compile times (cold, median of --repeats) for small and large schemas,
           regex, Lark and 128-tool call envelopes; a cached compile; the tokenizer build.
Every decode run goes through the real scheduler core and ModelRunner (workers/engine_loop.py).
With --threads 1 and `--clock cpu` (the default) times are this process's CPU time, which
holds still on a machine shared with other jobs (it includes the compile and mask work).

    python -m tools.bench structured [--threads 1] [--section decode,compile] [--batches 1,16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from justapi.model.gguf_file import default_model_path
from justapi.sampling import SamplingParams, StructuredOutput
from justapi.scheduler.structured import StructuredOutputs
from justapi.structured.compiler import GrammarCompiler
from justapi.structured.tokenizer import from_tokenizer
from justapi.wire.protocol import SubmitRequest
from workers.engine import LLMEngine
from workers.engine_loop import LoopOutput, SchedulerLoop

SMALL = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"], "additionalProperties": False}
VERBOSE = {"type": "object", "properties": {
    "product_identifier_code": {"type": "string", "maxLength": 12},
    "is_currently_available_in_stock": {"type": "boolean"},
    "warehouse_location_description": {"enum": ["north_distribution_center",
                                                "south_distribution_center"]},
    "number_of_units_remaining_in_inventory": {"type": "integer", "minimum": 0},
    "customer_satisfaction_rating_out_of_five": {"type": "integer", "minimum": 1, "maximum": 5},
    "requires_special_shipping_and_handling": {"type": "boolean"},
    "primary_material_used_in_manufacturing": {"enum": ["stainless_steel", "recycled_plastic",
                                                        "oak_wood"]},
    "estimated_delivery_time_in_business_days": {"type": "integer", "minimum": 1,
                                                 "maximum": 30}},
    "required": ["product_identifier_code", "is_currently_available_in_stock",
                 "warehouse_location_description", "number_of_units_remaining_in_inventory",
                 "customer_satisfaction_rating_out_of_five",
                 "requires_special_shipping_and_handling",
                 "primary_material_used_in_manufacturing",
                 "estimated_delivery_time_in_business_days"],
    "additionalProperties": False}
TOPICS = ["a kitchen kettle", "a pair of running shoes", "a desk lamp", "a garden hose",
          "a wool blanket", "a bicycle helmet", "a coffee grinder", "a travel backpack"]


@dataclass
class Run:
    tokens: list[int]  # per request
    seconds: float
    itl_s: list[float]
    stats: dict

    @property
    def tok_s(self) -> float:
        return sum(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    def itl_ms(self, q: float) -> float:
        return 1e3 * float(np.quantile(self.itl_s, q)) if self.itl_s else 0.0


class Bench:
    def __init__(self, model: str, clock: str) -> None:
        self.engine = LLMEngine(model, progress=False, num_blocks=4096, max_seqs=64)
        self.clock: Callable[[], float] = time.process_time if clock == "cpu" else time.perf_counter

    def prompts(self, what: str, batch: int) -> list[list[int]]:
        texts = [f"Describe {TOPICS[i % len(TOPICS)]} as {what} in JSON." for i in range(batch)]
        return [self.engine.encode(self.engine.chat_prompt([{"role": "user", "content": t}]))
                for t in texts]

    def run(self, prompts: list[list[int]], params: list[SamplingParams],
            structured: StructuredOutputs | None) -> Run:
        """One pass to completion, timing each step; a request's ITL samples are the times
        between the steps that delivered its tokens (its first delivery is not one)."""
        loop = SchedulerLoop(self.engine.runner, self.engine.loop_limits(), None, structured)
        ids = [f"b{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            loop.core.add_request(_submit(rid, prompt, p))
            loop.outputs[rid] = LoopOutput()
        last: dict[str, float] = {}
        itl: list[float] = []
        elapsed = 0.0
        with torch.inference_mode():
            while loop.core.has_work():
                before = {rid: len(loop.outputs[rid].token_ids) for rid in ids}
                start = self.clock()
                loop.step()
                elapsed += self.clock() - start
                for rid in ids:
                    if len(loop.outputs[rid].token_ids) > before[rid]:
                        if rid in last:
                            itl.append(elapsed - last[rid])
                        last[rid] = elapsed
        return Run([len(loop.outputs[rid].token_ids) for rid in ids], elapsed, itl, loop.stats())


def _submit(rid: str, prompt: list[int], params: SamplingParams) -> SubmitRequest:
    return SubmitRequest(rid, np.asarray(prompt, dtype=np.int32), params)


def structured_outputs(engine: LLMEngine, max_forced_tokens: int) -> StructuredOutputs:
    structured = engine.structured_outputs()  # one compiler (and cache) for every run
    structured.max_forced_tokens = max_forced_tokens
    return structured


HEADER = (f"{'':52s} {'tokens':>6s} {'tok/s':>7s} {'x free':>6s} {'ITL p50':>8s} {'ITL p99':>8s}"
          f" {'forced':>6s} {'mask ms/step':>12s}")


def row(label: str, run: Run, base: Run | None) -> str:
    s = run.stats
    forced = s.get("structured_forced_tokens", 0.0) / max(1, sum(run.tokens))
    mask = 1e3 * s.get("structured_mask_seconds", 0.0) / max(1.0, s.get("num_steps", 1.0))
    ratio = run.tok_s / base.tok_s if base else 1.0
    return (f"{label:52s} {sum(run.tokens):6d} {run.tok_s:7.1f} {ratio:6.2f} "
            f"{run.itl_ms(0.5):6.1f}ms {run.itl_ms(0.99):6.1f}ms {forced:6.0%} {mask:12.2f}")


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def section_decode(bench: Bench, batches: list[int], max_tokens: int, repeats: int) -> None:
    print(f"== constrained vs free decoding, greedy, same prompts and token counts (best of "
          f"{repeats}, runs alternating)")
    print(HEADER)
    for name, schema in (("small schema", SMALL), ("verbose schema", VERBOSE)):
        constraint = StructuredOutput("json_schema", json.dumps(schema))
        for batch in batches:
            prompts = bench.prompts(name.split()[0] + " fields", batch)
            constrained = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                          structured=constraint)] * batch
            twin = bench.run(prompts, constrained, structured_outputs(bench.engine, 32)).tokens
            free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in twin]
            configs = {"free": (free, None), "jump-forward (default)": (constrained, 32),
                       "masks only (no jump-forward)": (constrained, 0)}
            best: dict[str, Run] = {}
            for _ in range(repeats):
                for label, (params, forced) in configs.items():
                    run = _measured(bench, prompts, params, forced)
                    if label not in best or run.tok_s > best[label].tok_s:
                        best[label] = run
            for label, run in best.items():
                print(row(f"{name}, batch {batch}: {label}", run, best["free"]))
    stats = bench.engine.structured_outputs().stats()
    print(f"compile cache over these runs: {stats['structured_cache_hits']:.0f} hits of "
          f"{stats['structured_cache_hits'] + stats['structured_cache_misses']:.0f} lookups "
          f"({stats['structured_cache_hit_ratio']:.1%}), mean compile "
          f"{1e3 * stats['structured_compile_seconds'] / max(1, stats['structured_compiles']):.1f} ms")


def _measured(bench: Bench, prompts: list[list[int]], params: list[SamplingParams],
              max_forced_tokens: int | None) -> Run:
    """A run; its stats hold this run's share of the (shared) structured counters."""
    if max_forced_tokens is None:
        return bench.run(prompts, params, None)
    structured = structured_outputs(bench.engine, max_forced_tokens)
    before = structured.stats()
    run = bench.run(prompts, params, structured)
    after = structured.stats()
    run.stats = {**run.stats, **{k: after[k] - before[k] for k in before}}
    return run


def large_schema() -> dict:
    item = {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
        "price": {"type": "number", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5}},
        "required": ["sku", "quantity", "price"], "additionalProperties": False}
    address = {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["US", "CA", "MX", "FR", "DE"]}},
        "required": ["street", "city", "zip", "country"], "additionalProperties": False}
    return {"type": "object", "$defs": {"address": address, "item": item}, "properties": {
        "order_id": {"type": "string", "format": "uuid"},
        "created": {"type": "string", "format": "date-time"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
            "billing": {"$ref": "#/$defs/address"}, "shipping": {"$ref": "#/$defs/address"}},
            "required": ["name", "email", "billing"], "additionalProperties": False},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
        "payment": {"anyOf": [
            {"type": "object", "properties": {"card_last4": {"type": "string",
                                                             "pattern": "^[0-9]{4}$"}},
             "required": ["card_last4"], "additionalProperties": False},
            {"type": "object", "properties": {"iban": {"type": "string", "maxLength": 34}},
             "required": ["iban"], "additionalProperties": False}]},
        "notes": {"type": ["string", "null"], "maxLength": 200}},
        "required": ["order_id", "created", "customer", "items", "payment"],
        "additionalProperties": False}


def tools_schema(num_tools: int) -> dict:
    params = {"type": "object", "properties": {"location": {"type": "string"},
                                               "unit": {"enum": ["celsius", "fahrenheit"]},
                                               "days": {"type": "integer", "minimum": 1}},
              "required": ["location"], "additionalProperties": False}
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": f"tool_{i}"},
                                                        "arguments": params},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for i in range(num_tools)]}


def section_compile(bench: Bench, repeats: int) -> None:
    print("== grammar compile times (cold compile = the LLMatcher constructor; median of "
          f"{repeats}), wall time")
    start = time.perf_counter()
    compiler = GrammarCompiler(lambda: from_tokenizer(bench.engine.tokenizer,
                                                      bench.engine.model.params.vocab_size))
    _ = compiler.tokenizer
    print(f"{'tokenizer build + warm-up':34s} {1e3 * (time.perf_counter() - start):9.1f} ms")
    cases = [("small schema", StructuredOutput("json_schema", json.dumps(SMALL))),
             ("verbose schema", StructuredOutput("json_schema", json.dumps(VERBOSE))),
             ("large nested schema", StructuredOutput("json_schema", json.dumps(large_schema()))),
             ("regex (phone number)", StructuredOutput("regex", r"\(\d{3}\) \d{3}-\d{4}")),
             ("lark (a call grammar)", StructuredOutput("lark", 'start: "call(" ARG ("," ARG)* ")"'
                                                                '\nARG: /[a-z]+/')),
             ("8 tool envelopes", StructuredOutput("json_schema", json.dumps(tools_schema(8)))),
             ("128 tool envelopes", StructuredOutput("json_schema", json.dumps(tools_schema(128))))]
    for label, structured in cases:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            compiled = compiler.compile_now(structured)
            times.append(time.perf_counter() - start)
            assert compiled.prototype is not None, compiled.error
        print(f"{label:34s} {1e3 * statistics.median(times):9.2f} ms")
    future = compiler.submit(cases[2][1])
    future.result()
    start = time.perf_counter()
    compiler.submit(cases[2][1]).result().prototype.deep_copy()  # type: ignore[union-attr]
    print(f"{'large schema, cached + deep copy':34s} {1e3 * (time.perf_counter() - start):9.3f} ms")
    compiler.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench structured",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=5, help="compile timings")
    parser.add_argument("--decode-repeats", type=int, default=2, help="decode runs (best of)")
    parser.add_argument("--section", default="decode,compile")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: this process's CPU time (robust on a shared machine with "
                             "--threads 1); wall: elapsed time")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"model {args.model or default_model_path()}; torch threads {torch.get_num_threads()}; "
          f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; {args.clock} time")
    bench = Bench(args.model, args.clock)
    sections = args.section.split(",")
    if "decode" in sections:
        section_decode(bench, [int(b) for b in args.batches.split(",")], args.max_tokens,
                       args.decode_repeats)
    if "compile" in sections:
        section_compile(bench, args.repeats)


if __name__ == "__main__":
    main()
