"""`python -m tools.bench llama1b`: the ~1B llama shape at the sizes people run, against
llama-server - one stream, 16 streams and a shared prefix (the peer workloads `single`,
`batch`, `prefix`), the worker's memory against the file, and (workload `capacity`) both
engines' prefill and decode rates at 16 sequences outside any server.

The model: 16 layers, hidden 2048, 32 heads over 8 KV heads, FFN 8192 (~0.97B parameters),
random weights and the tiny synthetic tokenizer (workers/weights/synthetic.py), written as F16
and quantized to Q4_K_M by llama.cpp's own `llama-quantize` (so the blocks, the Q4_K/Q6_K mix
and the file are llama.cpp's), both cached; `--quant Q4_0` (or another llama-quantize type)
makes and measures that file instead. Never in CI: the F16 file is 1.9 GB.

    python -m tools.bench llama1b --llama-build /path/to/llama.cpp/build --threads 2 [--quant Q4_0]

Memory: `python -m tools.bench quant --memory-probe auto` on the file in a fresh process (what a
worker adds loading it under `auto`, warm-up included, the KV pool apart) over the file's size;
the target is at most 1.3x. Then `python -m tools.bench peer` with the file (its flags after
`--`).

Capacity (`--workloads capacity,...`): what each engine computes at the `batch` workload's
sizes (16 sequences, 128-token prompts, 128 out) with no server around it: llama.cpp's
`llama-batched-bench -npp 128 -ntg 128 -npl 16` (its default batch of 2048 and micro-batch of
512, llama-server's too; S_PP and S_TG) against this engine in-process under `auto` (the 16
prompts prefilled 4 a step, 512 tokens as the serve's chunk_size, then 128 decode steps of 16
rows; the times of the steps summed). The `batch` workload computes every prompt token and
every output token once, so no server of either engine can go past P * T / (P + T) output
tok/s (P, T: prefill and decode tok/s); the ratio of the two bounds is how far scheduling
alone can take the served ratio. Needs `bin/llama-batched-bench` in the build (docs/bench.md).
Owns: the model's recipe and this report. Does not own: the workloads (peer.py).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tools.bench import peer
from tools.bench.engine import run_steps
from tools.bench.quant import measure_memory
from workers.engine import LLMEngine
from workers.model.kernel_records import cpu_name
from workers.weights.synthetic import materialize

SHAPE = "synthetic:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=384,context=4096,type=F16"
QUANT = "Q4_K_M"
MEMORY_TARGET = 1.3
CAPACITY = (128, 128, 16)
"""Prompt tokens, output tokens and sequences of the capacity run: the `batch` workload's."""
STEP_TOKENS = 512
"""Prompt tokens a prefill step takes in the capacity run (the serve's chunk_size, llama.cpp's
micro-batch)."""


def quantized_model(llama_quantize: Path, cache_dir: Path, quant: str = QUANT) -> Path:
    """The `quant` file of SHAPE (made once: F16 by our writer, then llama-quantize)."""
    f16 = Path(materialize(SHAPE, str(cache_dir)))
    out = f16.with_name(f"{f16.stem}-{quant}.gguf")
    if not out.exists():
        tmp = out.with_suffix(".partial")
        threads = str(os.cpu_count() or 1)
        done = subprocess.run([str(llama_quantize), str(f16), str(tmp), quant, threads], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, out)
    return out


def report_memory(model: Path) -> None:
    file_mib = model.stat().st_size / 2**20
    memory = measure_memory(str(model), "auto")
    ratio = memory["added_mib"] / file_mib
    print(f"memory under auto: {memory['added_mib']:.0f} MiB added by the model (weights kept "
          f"{memory['weights_mib']:.0f} MiB) for a {file_mib:.0f} MiB file: {ratio:.2f}x "
          f"(target <= {MEMORY_TARGET}x, the KV pool apart)")


def parse_batched_bench(text: str) -> tuple[float, float]:
    """(S_PP, S_TG) tok/s of the first result row of llama-batched-bench's table."""
    header: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_PP t/s" in cells and "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[0].isdigit():
            return float(cells[header.index("S_PP t/s")]), float(cells[header.index("S_TG t/s")])
    raise ValueError("llama-batched-bench printed no result table")


def batch_bound(prefill: float, decode: float, prompt_tokens: int, output_tokens: int) -> float:
    """Output tok/s of a server that computes each request's prompt (at `prefill` tok/s) and
    its output (at `decode` tok/s) and does nothing else."""
    return output_tokens / (prompt_tokens / prefill + output_tokens / decode)


def llama_capacity(binary: Path, model: Path, threads: int) -> tuple[float, float]:
    prompt, out, seqs = CAPACITY
    if not binary.is_file():
        raise SystemExit(f"{binary} is missing: cmake --build <build> --target llama-batched-bench (docs/bench.md)")
    done = subprocess.run([str(binary), "-m", str(model), "-t", str(threads), "-c", str(2 * seqs * (prompt + out)),
                           "-npp", str(prompt), "-ntg", str(out), "-npl", str(seqs)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return parse_batched_bench(done.stdout)


def engine_capacity(model: Path, threads: int) -> tuple[float, float]:
    """This engine's prefill and decode tok/s at CAPACITY, in-process under `auto`, after one
    warm round (its first steps load kernels and plans)."""
    prompt, out, seqs = CAPACITY
    torch.set_num_threads(threads)
    engine = LLMEngine(str(model), num_blocks=seqs * (-(-(prompt + out + 1) // 16)) + 16, max_seqs=seqs,
                       progress=False, weights="auto")
    rng = np.random.default_rng(0)
    vocab = engine.model.params.vocab_size
    per_step = min(seqs, max(1, STEP_TOKENS // prompt))
    try:
        with torch.inference_mode():
            run_steps(engine, [rng.integers(0, vocab, prompt).tolist() for _ in range(per_step)], 4)
            prompts = [rng.integers(0, vocab, prompt).tolist() for _ in range(seqs)]
            prefill_s = sum(run_steps(engine, prompts[i:i + per_step], 0)[0] for i in range(0, seqs, per_step))
            _, steps = run_steps(engine, prompts, out)
    finally:
        engine.close()
    return seqs * prompt / prefill_s, seqs * out / sum(steps)


def report_capacity(build: Path, model: Path, threads: int) -> None:
    prompt, out, seqs = CAPACITY
    start = time.perf_counter()
    ours = engine_capacity(model, threads)
    theirs = llama_capacity(build / "bin" / "llama-batched-bench", model, threads)
    bounds = [batch_bound(p, t, prompt, out) for p, t in (ours, theirs)]
    print(f"capacity at {seqs} sequences ({prompt}-token prompts, {out} out), no server "
          f"({time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.2f}):")
    for label, a, b in (("prefill tok/s", ours[0], theirs[0]), ("decode tok/s", ours[1], theirs[1]),
                        ("batch workload's bound, output tok/s", bounds[0], bounds[1])):
        print(f"  {label:<38} justapi {a:7.1f}   llama.cpp {b:7.1f}   ratio {a / b:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench llama1b", description=__doc__.splitlines()[0])
    parser.add_argument("--llama-build", required=True, type=Path,
                        help="llama.cpp cmake build directory (bin/llama-quantize, bin/llama-server)")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(os.environ.get("JUSTAPI_CACHE_DIR") or Path(tempfile.gettempdir()) / "justapi-1b"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workloads", default="single,batch,prefix",
                        help="peer workloads, and `capacity` (both engines without a server)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--quant", default=QUANT, help=f"llama-quantize's type for the file (default {QUANT})")
    parser.add_argument("peer_args", nargs="*", help="after --: more flags for `tools.bench peer`")
    args = parser.parse_args(argv)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    model = quantized_model(args.llama_build / "bin" / "llama-quantize", args.cache_dir, args.quant)
    print(f"model: {model} ({model.stat().st_size / 2**20:.0f} MiB, {args.quant} by llama-quantize); "
          f"CPU {cpu_name()}, {args.threads} threads")
    if not args.skip_memory:
        report_memory(model)
    workloads = args.workloads.split(",")
    if "capacity" in workloads:
        report_capacity(args.llama_build, model, args.threads)
        workloads.remove("capacity")
    if workloads:
        peer.main(["--llama-server", str(args.llama_build / "bin" / "llama-server"), "--gguf", str(model),
                   "--threads", str(args.threads), "--workloads", ",".join(workloads), *args.peer_args])
