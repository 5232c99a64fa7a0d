"""`python -m tools.bench gemv`: one-row matmuls straight from GGUF blocks - justapi's int8 block
kernel (quant_matmul_i8, the path a decode step of one sequence takes) against llama.cpp's ggml
on the same bytes, CPU and thread count, in turns in one process (tools/bench/ggml_gemv.c).

Needs a llama.cpp build (`--llama-build DIR`: the cmake build directory with bin/libggml*.so;
docs/bench.md says how to build one from the llama-cpp-python sdist). `--avx2` builds our
kernel without AVX-512 and VNNI, as an AVX2 CPU (Zen 3) runs it: compare it with llama.cpp's
AVX2 build. Prints GB/s of weights read per side (best and median round) and the ratio of
medians against ggml's faster variant (plain, or the repacked layout llama-server uses for
Q4_0 and Q4_K on AVX2). Read only ratios on a shared host; `--threads 1` times both sides in
the thread's CPU time, which other processes' turns on the core do not inflate.
Owns: this comparison. Does not own: the kernels.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from workers.model.cpu_kernels import build
from workers.model.kernel_records import cpu_name

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
REPACKED = {"Q4_0", "Q4_K"}
"""Types llama-server keeps in its repacking buffer on x86 with AVX2 (ggml-cpu/repack.cpp)."""
AVX2_ONLY = ("-mno-avx512f", "-mno-avxvnni", "-mno-avx512vnni")
HARNESS = Path(__file__).with_name("ggml_gemv.c")


def harness(llama_build: Path) -> Path:
    """ggml_gemv.c compiled against the build's ggml (cached by source and build path)."""
    include = llama_build.parent / "ggml" / "include"
    lib = llama_build / "bin"
    if not (lib / "libggml-cpu.so").exists() or not (include / "ggml.h").exists():
        raise SystemExit(f"{llama_build} is not a llama.cpp build (no bin/libggml-cpu.so or ../ggml/include)")
    key = hashlib.sha256(HARNESS.read_bytes() + str(llama_build.resolve()).encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"justapi-ggml-gemv-{os.getuid()}-{key}"
    if not out.exists():
        subprocess.run(["cc", "-O2", str(HARNESS), "-o", str(out), f"-I{include}", f"-L{lib}", "-lggml", "-lggml-base",
                        "-lggml-cpu", f"-Wl,-rpath,{lib}", "-ldl", "-lm"], check=True)
    return out


def run_type(program: Path, ours: Path, type_name: str, shape: tuple[int, int], threads: int, rounds: int,
             copies: int, rows: int = 1, panels: bool = False) -> dict[str, tuple[float, float]]:
    """{side: (best GB/s, median GB/s)} for one type, 'diff <side>' lines as (diff, 0), and
    'same_bits' (1.0 where the packed kernel gave the plain one's bits)."""
    n, k = shape
    repack = int(type_name in REPACKED and n % 8 == 0)
    done = subprocess.run([str(program), str(ours), str(TYPES[type_name]), str(n), str(k), str(threads),
                           str(rounds), str(copies), str(repack), str(rows), str(int(panels))], capture_output=True, text=True, check=True)
    out: dict[str, tuple[float, float]] = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if parts[0] == "same_bits":
            out["same_bits"] = (float(parts[1]), 0.0)
        elif parts[0] == "diff":
            out[f"diff {parts[1]}"] = (float(parts[2]), 0.0)
        else:
            out[parts[0]] = (float(parts[1]), float(parts[2]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench gemv", description=__doc__.splitlines()[0])
    parser.add_argument("--llama-build", required=True, type=Path, help="llama.cpp cmake build directory")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--shape", default="8192x2048", help="out x in features (a 1B model's gate/up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1, help="rows of x per call (16: a 16-stream decode step)")
    parser.add_argument("--panels", action="store_true", help="ours through the int8 panels (steps of many rows)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--stream-mib", type=int, default=96,
                        help="copies of the matrix to cycle through: at least this many MiB (past the caches)")
    parser.add_argument("--avx2", action="store_true", help="our kernel built for AVX2 only (no AVX-512, no VNNI)")
    args = parser.parse_args(argv)
    n, k = (int(v) for v in args.shape.split("x"))
    ours = build("quant_matmul", AVX2_ONLY if args.avx2 else ())
    program = harness(args.llama_build)
    print(f"CPU {cpu_name()} ({platform.machine()}), {args.threads} threads, {n}x{k}, ours "
          f"{'AVX2 only' if args.avx2 else '-march=native'}, ggml from {args.llama_build}; "
          f"load average {os.getloadavg()[0]:.1f}; GB/s of weights, best / median of {args.rounds} rounds in turns")
    print(f"{'type':<5} | {'justapi':>15} | {'justapi packed':>15} | {'ggml':>15} | {'ggml repacked':>15} | "
          f"justapi (best of its sides) / ggml's best (medians); {args.rows} rows of x"
          f"{', ours by the int8 panels' if args.panels else ''}")
    for type_name in args.types.split(","):
        bytes_per_copy = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}.get(type_name, 0) * n * k // 32 or \
            {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name] * n * k // 256
        copies = max(2, min(256, -(-(args.stream_mib << 20) // bytes_per_copy)))
        sides = run_type(program, ours, type_name, (n, k), args.threads, args.rounds, copies, args.rows, args.panels)
        best_ggml = max(v[1] for name, v in sides.items() if name.startswith("ggml"))
        best_ours = max(v[1] for name, v in sides.items() if name.startswith("justapi"))
        cells = [f"{sides[s][0]:6.2f} / {sides[s][1]:6.2f}" if s in sides else f"{'-':>15}"
                 for s in ("justapi", "justapi_packed", "ggml", "ggml_repack")]
        bits = {1.0: ", packed: the same bits", 0.0: ", packed: OTHER BITS"}.get(sides.get("same_bits", (-1,))[0], "")
        print(f"{type_name:<5} | " + " | ".join(cells) + f" | {best_ours / best_ggml:.2f}x"
              f"   (outputs differ by {max(v[0] for s, v in sides.items() if s.startswith('diff')):.1e}{bits})")
