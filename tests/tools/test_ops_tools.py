"""tools/status.py, health.py, drain.py, flush_cache.py and gguf_info.py without a server:
their tables (GPU figures included), --help, one-line errors and exit codes when nothing runs,
and what gguf_info finds in a tiny model and the default one."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS_DIR))

import gguf_info  # noqa: E402
import ops_cli  # noqa: E402
from health import render as render_health  # noqa: E402
from status import render as render_status  # noqa: E402

from justapi.wire.protocol import StatusReply  # noqa: E402

WORKERS = [
    {"worker_id": 0, "pool_id": 0, "pid": 101, "device": "cuda:0", "healthy": False,
     "reason": "GPU cuda:0 reported XID 79 (GPU has fallen off the bus)", "heartbeat_age_s": 2.5,
     "step_age_s": 0.0, "rss_bytes": 3 << 30, "cpu_time_s": 12.5, "num_restarts": 1,
     "draining": False, "num_requests_running": 0, "busy": False,
     "pool": {"kind": "cuda_ipc", "num_blocks": 4000, "is_mapped": True}},
    {"worker_id": 1, "pool_id": 1, "pid": 102, "device": "cuda:1", "healthy": True, "reason": "",
     "heartbeat_age_s": 0.2, "step_age_s": 0.01, "rss_bytes": 2 << 30, "cpu_time_s": 30.0,
     "num_restarts": 0, "draining": True, "num_requests_running": 3, "busy": True,
     "pool": {"kind": "cuda_ipc", "num_blocks": 4000, "is_mapped": True}},
]
GPUS = [{"cuda_index": 1, "name": "NVIDIA H100", "temperature_c": 71.0,
         "slowdown_temperature_c": 90.0, "memory_used_bytes": 60 << 30,
         "memory_total_bytes": 80 << 30, "utilization_percent": 88.0, "power_watts": 512.5,
         "power_limit_watts": 700.0, "throttle_reasons": ["sw_power_cap"], "ecc_corrected": 2,
         "ecc_uncorrected": 0, "xids": [13]}]
STATS = {"pool_0_kv_usage": 0.0, "pool_1_kv_usage": 0.25, "pool_1_num_requests_waiting": 5,
         "pool_1_num_requests_running": 3, "pool_1_kv_blocks_free": 2900,
         "pool_1_prefix_cache_blocks": 120, "prefix_cache_hits": 30, "prefix_cache_misses": 10,
         "prefix_cache_hit_ratio": 0.75, "prefix_cache_blocks": 120, "num_requests": 40,
         "num_finished": 32, "num_errors": 0, "num_preemptions": 1, "num_steps": 999,
         "kv_blocks_in_use": 1000, "kv_blocks_total": 8000}
REPLY = StatusReply(time_s=0.0, uptime_s=3725.0, healthy=False,
                    problems=["pool 0 has no healthy worker"],
                    warnings=["worker 0 unhealthy: GPU cuda:0 reported XID 79 (GPU has fallen "
                              "off the bus)", "worker 1 is draining"],
                    stats=STATS, workers=WORKERS, gpus=GPUS, nvml="ok")


def test_status_table():
    text = render_status(REPLY, "ipc:///x/admin.sock")
    assert text.splitlines()[0] == "server ipc:///x/admin.sock  up 1h02m05s  UNHEALTHY"
    assert "problem: pool 0 has no healthy worker" in text
    assert "warning: worker 1 is draining" in text
    worker_1 = next(line for line in text.splitlines() if line.startswith(" 1     1"))
    assert worker_1.split()[:8] == ["1", "1", "102", "cuda:1", "ok", "yes", "3", "yes"]
    assert "25.0%" in worker_1 and "2.0 GiB" in worker_1
    assert "DOWN: GPU cuda:0 reported XID 79" in text
    pool_1 = next(line for line in text.splitlines() if line.startswith("   1"))
    assert pool_1.split() == ["1", "5", "3", "25.0%", "2900", "120"]
    assert "30 block hits / 10 misses (hit ratio 0.750)" in text
    assert "requests 40, finished 32" in text


def test_health_table_includes_nvml_figures():
    text = render_health(REPLY)
    assert text.splitlines()[0] == "UNHEALTHY; NVML: ok"
    gpu = next(line for line in text.splitlines() if line.startswith("cuda:1"))
    for figure in ("NVIDIA H100", "71", "60.0 GiB", "80.0 GiB", "88", "512", "sw_power_cap", "13"):
        assert figure in gpu
    assert "cuda_ipc 4000 blocks" in text and "XID 79" in text


def test_table_aligns_numbers_right_and_shows_missing_as_dash():
    assert ops_cli.table(["a", "bb"], [[1, None], [100, "x"]]).splitlines() == [
        "  a  bb", "  1  -", "100  x"]
    assert ops_cli.human_bytes(1536) == "1.5 KiB" and ops_cli.human_bytes(None) is None
    assert ops_cli.seconds(59.94) == "59.9s" and ops_cli.seconds(61) == "1m01s"


@pytest.mark.parametrize("tool", ["status.py", "drain.py", "flush_cache.py", "health.py",
                                  "gguf_info.py"])
def test_every_tool_has_help(tool: str):
    result = subprocess.run([sys.executable, str(TOOLS_DIR / tool), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "usage:" in result.stdout
    if tool != "gguf_info.py":
        assert "--admin ENDPOINT" in result.stdout and "--json" in result.stdout


def test_no_server_is_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("JUSTAPI_STATE_DIR", str(tmp_path))
    result = subprocess.run([sys.executable, str(TOOLS_DIR / "status.py")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"status.py: error: no running justapi server found in {tmp_path} (start one with "
        "`justapi serve`, or pass --admin ENDPOINT)"]
    result = subprocess.run([sys.executable, str(TOOLS_DIR / "drain.py"), "0", "--admin",
                             f"ipc://{tmp_path}/gone.sock"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "no admin socket at" in result.stderr


def test_gguf_info_on_a_tiny_model(tiny_gguf, capsys):
    path = tiny_gguf(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=256)
    assert gguf_info.main([path, "--json", "--seqs", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    shapes = report["shapes"]
    assert (shapes["num_layers"], shapes["hidden_size"], shapes["num_heads"],
            shapes["num_kv_heads"], shapes["head_dim"], shapes["ffn_size"]) == (2, 64, 4, 2, 16, 128)
    assert report["model"]["num_parameters"] == sum(math.prod(t["shape"]) for t in report["tensors"])
    fp32 = report["memory"]["rows"][0]
    # KV: layers x (K and V) x kv_heads x head_dim x 4 bytes per token; 2 sequences of 256.
    assert fp32["dtype"] == "fp32" and fp32["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert fp32["kv_bytes"] == fp32["kv_bytes_per_token"] * 256 * 2
    assert fp32["weights_bytes"] == report["model"]["num_parameters"] * 4
    assert report["memory"]["rows"][1]["weights_bytes"] == report["model"]["num_parameters"] * 2
    assert report["tokenizer"]["num_tokens"] == shapes["vocab_size"]
    assert sum(r["num_tensors"] for r in report["tensor_types"]) == report["file"]["num_tensors"]


def test_gguf_info_on_the_default_model(smollm2_path, capsys):
    assert gguf_info.main([smollm2_path, "--tensors"]) == 0
    text = capsys.readouterr().out
    assert "model  Smollm2 135M" in text and "llama, MOSTLY_Q4_1, 134.5 M parameters" in text
    assert "layers 30, hidden 576, heads 9 (kv 3, head dim 64), ffn 1536, context 8192" in text
    assert "Q4_1      210" in text and "eos 2 '<|im_end|>'" in text
    assert "368 characters (jinja)" in text
    fp32 = next(line for line in text.splitlines() if line.strip().startswith("fp32"))
    assert "513.1 MiB" in fp32 and "45.0 KiB" in fp32 and "360.0 MiB" in fp32
    assert "blk.0.attn_q.weight" in text


def test_gguf_info_bad_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, definitely not" * 3)
    assert gguf_info.main([str(bad)]) == 1
    assert capsys.readouterr().err.strip() == \
        f"gguf_info.py: error: {bad}: not a GGUF file (bad magic or too short)"
