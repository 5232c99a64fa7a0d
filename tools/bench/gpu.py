"""The GPU data plane's figures: decode tok/s and step time per batch size, each step taken
three ways in turns (same engine, same pool, alternating order):

- graphs:   in-place Triton attention, the step replayed from its CUDA graph (the default)
- eager:    the same padded step, its kernels launched from Python (`--no-cuda-graphs`)
- gathered: the previous data plane: each sequence's KV blocks gathered, then torch's SDPA

For each model: SmolLM2-135M (the embedded GGUF where installed, else a synthetic model of its
exact shape) and a synthetic ~1B llama. `--weights` is the served flag: fp32 (the default
here: dense bf16 on the GPU) or auto (the file's GGUF blocks kept in device memory, decoded in
the matmuls: workers/weights/device_linear.py). Beside them: the device-to-device copy
bandwidth measured in the same run, at batch 1 the share of it a decode step reaches streaming
the weights it reads (their bytes as kept / step time), the weights' device memory against
the file, and with `--mixed-chunk N` a step that decodes the largest batch <= 64 and takes a
new N-token prompt chunk against the same batch's uniform step, in turns. `--json PATH` writes
every figure. On a CPU (`--device cpu`, or JUSTAPI_TEST_GPU_DEVICE=cpu) it is a dry run on a
tiny model: Triton's interpreter stands in for the GPU and plain calls for the graphs; its
figures mean nothing.

    python -m tools.bench gpu [--json out.json] [--batches 1,16,64,256] [--decode-steps 32]
        [--weights fp32|auto] [--modes graphs,eager,gathered] [--mixed-chunk 256]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

DEVICE_ENV = "JUSTAPI_TEST_GPU_DEVICE"
SMOLLM2_SHAPE = ("synthetic:layers=30,hidden=576,heads=9,kv_heads=3,ffn=1536,vocab=49152,context=8192,"
                 "type=Q4_1,embed_type=Q8_0")
"""SmolLM2-135M-Instruct's shape and tensor types (Q4_1 matrices, a tied Q8_0 embedding), random."""
LLAMA_1B_SHAPE = "synthetic:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=32000,context=4096,type=F16"
DRY_RUN_SHAPE = "synthetic:layers=1,hidden=64,heads=4,kv_heads=2,ffn=64,vocab=320,context=256"
LLAMA_1B_Q4_K_M = ("synthetic:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=32000,"
                   "context=4096,type=Q4_K_M,tied=false")
"""The ~1B llama shape as llama.cpp's Q4_K_M mix of random blocks (workers/weights/synthetic.py)."""
DRY_RUN_Q4_K_M = "synthetic:layers=1,hidden=256,heads=4,kv_heads=2,ffn=256,vocab=320,context=2048,type=Q4_K_M,tied=false"
MODES = ("graphs", "eager", "gathered")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=os.environ.get(DEVICE_ENV, "cuda"))
    parser.add_argument("--models", default="", help="';'-separated GGUF paths / synthetic: specs / smollm2 "
                        "(default: SmolLM2 and the 1B shape; a dry run: a tiny model)")
    parser.add_argument("--batches", default="", help="default 1,16,64,256 (dry run: 1,2)")
    parser.add_argument("--decode-steps", type=int, default=0, help="timed steps per run (32; dry run 2)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="turns of the three modes")
    parser.add_argument("--json", default="", help="write the figures here")
    parser.add_argument("--profile", action="store_true",
                        help="also list the kernels of each model's batch-1 graph by device time")
    parser.add_argument("--weights", default="fp32", choices=("fp32", "auto"),
                        help="fp32: dense bf16 on the GPU; auto: the GGUF blocks in device memory")
    parser.add_argument("--modes", default=",".join(MODES), help="which of graphs,eager,gathered")
    parser.add_argument("--mixed-chunk", type=int, default=0,
                        help="also time steps of decodes + one new prompt chunk of this many tokens")
    args = parser.parse_args(argv)
    args.modes = tuple(m for m in MODES if m in args.modes.split(","))
    if not args.modes or "graphs" not in args.modes:
        parser.error("--modes must include graphs")
    is_dry = args.device == "cpu"
    args.models = args.models or (DRY_RUN_SHAPE if is_dry else f"smollm2;{LLAMA_1B_SHAPE}")
    args.batches = [int(b) for b in (args.batches or ("1,2" if is_dry else "1,16,64,256")).split(",")]
    args.decode_steps = args.decode_steps or (2 if is_dry else 32)
    if is_dry:
        args.prompt_tokens, args.rounds = min(args.prompt_tokens, 8), 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cpu":  # before anything imports triton: its interpreter stands in for the GPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from tools.bench.gpu_run import copy_bandwidth, measure_model
    if args.device != "cpu" and not torch.cuda.is_available():
        print("python -m tools.bench gpu: no CUDA GPU here (a CPU dry run: --device cpu)", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": _device_name(args.device), "torch": torch.__version__,
                              "weights": args.weights, "modes": list(args.modes),
                              "copy_bandwidth_bytes_per_s": copy_bandwidth(args.device),
                              "batches": args.batches, "decode_steps": args.decode_steps,
                              "prompt_tokens": args.prompt_tokens, "models": []}
    print(f"{report['device']}: device-to-device copy {report['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s "
          "(bytes read + written)", flush=True)
    for model in args.models.split(";"):
        report["models"].append(measure_model(model, args, report["copy_bandwidth_bytes_per_s"]))
        if args.json:  # after each model: a run cut short by a timeout keeps what it measured
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
    print(summary(report))
    return 0


def _device_name(device: str) -> str:
    import torch

    if device == "cpu":
        return "cpu (dry run: figures mean nothing)"
    return torch.cuda.get_device_name(torch.device(device))


def summary(report: dict[str, Any]) -> str:
    """The table printed last: per model and batch, tok/s (median step ms) of each mode, and
    the median replay of the batch's graph alone (the device's part of a graphed step)."""
    modes = [m for m in MODES if m in report.get("modes", MODES)]
    lines = [f"{'model':<34} {'batch':>5} " + " ".join(f"{m + ' tok/s (ms)':>24}" for m in modes)
             + f" {'graphs/eager':>12} {'replay ms':>9}"]
    for model in report["models"]:
        for row in model["decode"]:
            cells = [f"{row[m]['tok_per_s']:>12.0f} ({row[m]['median_step_ms']:7.3f})" for m in modes]
            ratio = (row["eager"]["median_step_ms"] / row["graphs"]["median_step_ms"]
                     if "eager" in row else float("nan"))
            lines.append(f"{model['name'][:34]:<34} {row['batch']:>5} " + " ".join(f"{c:>24}" for c in cells)
                         + f" {ratio:>12.2f} {row.get('replay_ms', float('nan')):>9.3f}")
        share = model.get("batch1_bandwidth_share")
        if share is not None:
            lines.append(f"  {model['name'][:32]}: batch 1 streams {model['weight_bytes'] / 2**30:.2f} GiB of "
                         f"weights per step = {share:.0%} of the measured copy bandwidth; "
                         f"{model['graph_capture']}")
        if model.get("file_bytes"):
            lines.append(f"  weights ({model['weights']}) take {model['weight_memory_bytes'] / 2**30:.2f} GiB "
                         f"of device memory, {model['weight_memory_bytes'] / model['file_bytes']:.2f}x "
                         f"the {model['file_bytes'] / 2**30:.2f} GiB file")
        mixed = model.get("mixed")
        if mixed:
            lines.append(f"  mixed step (batch {mixed['batch']} + a {mixed['chunk']}-token chunk) "
                         f"{mixed['mixed_ms']:.3f} ms vs uniform {mixed['uniform_ms']:.3f} ms: "
                         f"{mixed['ratio']:.2f}x")
    return "\n".join(lines)


def median_ms(step_s: list[float]) -> float:
    return statistics.median(step_s) * 1e3


def now() -> float:
    return time.perf_counter()


if __name__ == "__main__":
    sys.exit(main())
