"""The GPU check's last lines (tools/bench/gpu_targets.py): each issue-38 target reads the right
figure of the offline and served JSON, says met / NOT MET against its bound (upper or lower),
and "not measured" where a run was cut short."""
from __future__ import annotations

from tools.bench.gpu_targets import lines

ONE_B = "layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192"


def offline() -> dict:
    decode = [{"batch": b, "graphs": {"tok_per_s": t}} for b, t in ((1, 1200.0), (16, 15000.0), (64, 40000.0))]
    return {"device": "NVIDIA H100", "weights": "auto", "models": [
        {"name": ONE_B, "decode": decode, "batch1_bandwidth_share": 0.55, "weight_memory_bytes": 700,
         "file_bytes": 600, "mixed": {"ratio": 1.2}}]}


def served() -> dict:
    return {"models": [{"name": ONE_B, "single": {"decode_tok_per_s": 1100.0},
                        "batch-16": {"decode_tok_per_s": 13000.0, "tpot_p50_ms": 1.0},
                        "batch-64": {"decode_tok_per_s": 24000.0},
                        "burst": {"decode_tpot_p50_ms": 1.5}, "structured": {"ratio": 0.95}}]}


def status(text: str, target: str) -> tuple[str, str]:
    """(the figure, met / NOT MET / not measured) of the line whose target starts so."""
    line = next(line for line in text.splitlines() if line.strip().startswith(target))
    if line.endswith("not measured"):
        return "", "not measured"
    verdict = "NOT MET" if line.endswith("NOT MET") else "met"
    return line.split()[-3 if verdict == "met" else -4], verdict


def test_every_target_reads_its_figure_and_says_whether_it_is_met():
    text = "\n".join(lines(offline(), served()))
    model = ONE_B[:24]
    assert status(text, "1B Q4_K_M batch 1 served") == ("1,100.00", "met")
    assert status(text, "1B Q4_K_M batch-1 step") == ("55.00", "NOT MET")  # a share of 60%
    assert status(text, "1B Q4_K_M weights") == ("1.17", "met")  # 700 / 600 <= 1.3
    assert status(text, "1B Q4_K_M batch 64") == ("24,000.00", "NOT MET")
    assert status(text, f"{model} served/offline at 1 ") == ("0.92", "met")  # 1,100 / 1,200
    assert status(text, f"{model} served/offline at 16 ") == ("0.87", "NOT MET")
    assert status(text, f"{model} served/offline at 64 ") == ("0.60", "NOT MET")
    assert status(text, f"{model} mixed step") == ("1.20", "met")  # at most 1.3
    assert status(text, f"{model} decode TPOT in bursts") == ("1.50", "NOT MET")
    assert status(text, f"{model} structured") == ("0.95", "met")


def test_a_cut_run_prints_not_measured():
    text = "\n".join(lines({}, {}))
    assert text.count("not measured") == 4 and "no offline run" in text
