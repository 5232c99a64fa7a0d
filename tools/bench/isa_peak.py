"""`python -m tools.bench isa-peak`: the rate of each instruction the int8 and float kernels lean
on, on the CPU at hand - vpmaddubsw (the AVX2 int8 path), vpdpbusd on 256- and 512-bit registers
(VNNI), and fp32 FMAs on both - as instructions and multiply-adds a second and a cycle, in this
thread's CPU time, best of `--rounds`. It tells how near a kernel runs to the unit it waits on
(e.g. 16 rows of Q4_K at N G multiply-adds a second against dpbusd_ymm's peak) and what a wider
form could give on this CPU family: the register widths' rates differ by family (a Zen 4 runs
512-bit operations as two 256-bit halves; an Intel Xeon core has its own 512-bit units).
Probes the CPU lacks are left out. The clock is a chain of dependent adds run before and after
(the lower figure is used). On a shared host the figures swing between runs: keep the best.

    python -m tools.bench isa-peak [--rounds 5]

Owns: this probe (tools/bench/isa_peak.c). Does not own: the kernels.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from workers.model.kernel_records import cpu_name

SOURCE = Path(__file__).with_name("isa_peak.c")
REFERENCE = "dpbusd_ymm"
"""The probe the others are compared with: what the packed kernels' 8-row tiles issue."""


def probe_binary() -> Path:
    """isa_peak.c compiled once (cached by source) in the temporary directory."""
    key = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"justapi-isa-peak-{os.getuid()}-{key}"
    if not out.exists():
        tmp = out.with_name(out.name + f".{os.getpid()}")
        subprocess.run(["cc", "-O2", str(SOURCE), "-o", str(tmp)], check=True)
        os.replace(tmp, out)
    return out


def measure(rounds: int, count: int) -> tuple[float, dict[str, tuple[float, int]]]:
    """(clock Hz, {probe: (best instructions a second, multiply-adds an instruction)}) over
    `rounds` runs of `count` instructions a probe."""
    binary, clock = probe_binary(), 0.0
    best: dict[str, tuple[float, int]] = {}
    for _ in range(rounds):
        lines = subprocess.run([str(binary), str(count)], capture_output=True, text=True, check=True).stdout
        clocks = []
        for line in lines.splitlines():
            name, rate, macs = line.split()
            if name == "clock":
                clocks.append(float(rate))
            elif float(rate) > best.get(name, (0.0, 0))[0]:
                best[name] = (float(rate), int(macs))
        clock = max(clock, min(clocks))
    return clock, best


def report(clock: float, best: dict[str, tuple[float, int]]) -> list[str]:
    reference = best.get(REFERENCE)
    lines = [f"{'probe':<12} {'G instr/s':>10} {'per cycle':>10} {'G mul-add/s':>12} {'vs ' + REFERENCE:>16}"]
    for name, (rate, macs) in best.items():
        versus = f"{rate * macs / (reference[0] * reference[1]):.2f}x" if reference else "-"
        lines.append(f"{name:<12} {rate / 1e9:10.2f} {rate / clock:10.2f} {rate * macs / 1e9:12.1f} {versus:>16}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench isa-peak", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=100_000_000, help="instructions a probe a round")
    args = parser.parse_args(argv)
    clock, best = measure(args.rounds, args.count)
    print(f"CPU {cpu_name()}; clock {clock / 1e9:.2f} GHz (a chain of dependent adds); best of "
          f"{args.rounds} rounds, one thread, in its CPU time")
    print("\n".join(report(clock, best)))
