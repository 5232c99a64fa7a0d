"""Issue 38's GPU targets, each with its figure, from the JSON of `python -m tools.bench gpu`
(offline, --weights auto) and `python -m tools.bench gpu-serve` (served): what the GPU check
(tools/gpu_check.sh) prints last. A figure missing from the files (a run cut short) prints as
"not measured".

    python -m tools.bench gpu-targets OFFLINE.json SERVED.json
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

ONE_B = "layers=16,hidden=2048"
"""How the ~1B Q4_K_M shape's name starts (tools/bench/gpu.py's LLAMA_1B_Q4_K_M)."""


def _model(report: dict[str, Any], prefix: str) -> dict[str, Any]:
    return next((m for m in report.get("models", []) if m["name"].startswith(prefix)), {})


def _offline_tok_per_s(model: dict[str, Any], batch: int) -> float | None:
    row = next((r for r in model.get("decode", []) if r["batch"] == batch), None)
    return row["graphs"]["tok_per_s"] if row else None


def _line(target: str, figure: float | None, goal: float, unit: str, higher: bool = True) -> str:
    if figure is None:
        return f"  {target:<58} not measured"
    met = figure >= goal if higher else figure <= goal
    return f"  {target:<58} {figure:>10,.2f} {unit:<6} {'met' if met else 'NOT MET'}"


def lines(offline: dict[str, Any], served: dict[str, Any]) -> list[str]:
    out = [f"GPU targets ({offline.get('device', 'no offline run')}, weights {offline.get('weights', '?')}):"]
    one_b, one_b_served = _model(offline, ONE_B), _model(served, ONE_B)
    single = one_b_served.get("single", {})
    out.append(_line("1B Q4_K_M batch 1 served >= 1,000 tok/s (1 / TPOT)", single.get("decode_tok_per_s"), 1000, "tok/s"))
    share = one_b.get("batch1_bandwidth_share")
    out.append(_line("1B Q4_K_M batch-1 step >= 60% of copy bandwidth", None if share is None else 100 * share, 60, "%"))
    memory = (one_b["weight_memory_bytes"] / one_b["file_bytes"]) if one_b.get("file_bytes") else None
    out.append(_line("1B Q4_K_M weights in device memory <= 1.3x the file", memory, 1.3, "x", higher=False))
    batch64 = one_b_served.get("batch-64", {})
    out.append(_line("1B Q4_K_M batch 64 served >= 25,000 tok/s (64 / TPOT)", batch64.get("decode_tok_per_s"), 25000, "tok/s"))
    for model in served.get("models", []):
        offline_model = _model(offline, model["name"])
        for streams, key in ((1, "single"), (16, "batch-16"), (64, "batch-64")):
            got, want = model.get(key, {}).get("decode_tok_per_s"), _offline_tok_per_s(offline_model, streams)
            ratio = got / want if got and want else None
            out.append(_line(f"{model['name'][:24]} served/offline at {streams} streams >= 0.9x", ratio, 0.9, "x"))
    for model in offline.get("models", []):
        mixed = model.get("mixed")
        out.append(_line(f"{model['name'][:24]} mixed step / uniform <= 1.3x (offline)",
                         mixed["ratio"] if mixed else None, 1.3, "x", higher=False))
    for model in served.get("models", []):
        burst, batch16 = model.get("burst", {}), model.get("batch-16", {})
        decode, uniform = burst.get("decode_tpot_p50_ms"), batch16.get("tpot_p50_ms")
        out.append(_line(f"{model['name'][:24]} decode TPOT in bursts / batch-16 <= 1.3x",
                         decode / uniform if decode and uniform else None, 1.3, "x", higher=False))
        structured = model.get("structured", {})
        out.append(_line(f"{model['name'][:24]} structured / free tok/s >= 0.9x", structured.get("ratio"), 0.9, "x"))
    return out


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench gpu-targets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("offline", help="the JSON of `python -m tools.bench gpu`")
    parser.add_argument("served", help="the JSON of `python -m tools.bench gpu-serve`")
    args = parser.parse_args(argv)
    print("\n".join(lines(_load(args.offline), _load(args.served))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
