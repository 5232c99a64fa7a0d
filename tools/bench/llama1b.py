"""`python -m tools.bench llama1b`: the ~1B llama shape at the sizes people run, against
llama-server - one stream, 16 streams and a shared prefix (the peer workloads `single`,
`batch`, `prefix`), and the worker's memory against the file.

The model: 16 layers, hidden 2048, 32 heads over 8 KV heads, FFN 8192 (~0.97B parameters),
random weights and the tiny synthetic tokenizer (workers/weights/synthetic.py), written as F16
and quantized to Q4_K_M by llama.cpp's own `llama-quantize` (so the blocks, the Q4_K/Q6_K mix
and the file are llama.cpp's), both cached; `--quant Q4_0` (or another llama-quantize type)
makes and measures that file instead. Never in CI: the F16 file is 1.9 GB.

    python -m tools.bench llama1b --llama-build /path/to/llama.cpp/build --threads 2 [--quant Q4_0]

Memory: `python -m tools.bench quant --memory-probe auto` on the file in a fresh process (what a
worker adds loading it under `auto`, warm-up included, the KV pool apart) over the file's size;
the target is at most 1.3x. Then `python -m tools.bench peer` with the file (its flags after
`--`). Owns: the model's recipe and this report. Does not own: the workloads (peer.py).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from tools.bench import peer
from tools.bench.quant import measure_memory
from workers.model.kernel_records import cpu_name
from workers.weights.synthetic import materialize

SHAPE = "synthetic:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=384,context=4096,type=F16"
QUANT = "Q4_K_M"
MEMORY_TARGET = 1.3


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench llama1b", description=__doc__.splitlines()[0])
    parser.add_argument("--llama-build", required=True, type=Path,
                        help="llama.cpp cmake build directory (bin/llama-quantize, bin/llama-server)")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(os.environ.get("JUSTAPI_CACHE_DIR") or Path(tempfile.gettempdir()) / "justapi-1b"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workloads", default="single,batch,prefix")
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
    peer.main(["--llama-server", str(args.llama_build / "bin" / "llama-server"), "--gguf", str(model),
               "--threads", str(args.threads), "--workloads", args.workloads, *args.peer_args])
