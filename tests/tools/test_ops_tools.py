"""`justapi status`, `health`, `drain`, `flush-cache`, `keys`, `inspect` and `perplexity`
without a server: their tables (GPU figures included), --help and `justapi --help` listing
them, one-line errors and exit codes when nothing runs, the key pair `keys` writes, and what
`inspect` finds in a tiny model and the default one."""
from __future__ import annotations

import json
import math
import os
import re
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

from justapi import cli
from justapi.ops import admin_cli
from justapi.ops.health import render as render_health
from justapi.ops.status import render as render_status
from justapi.wire.auth import read_secret_key
from justapi.wire.protocol import StatusReply

OPS_COMMANDS = ("status", "health", "drain", "flush-cache", "keys", "inspect", "perplexity", "doctor")
ADMIN_COMMANDS = ("status", "health", "drain", "flush-cache")

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
    assert admin_cli.table(["a", "bb"], [[1, None], [100, "x"]]).splitlines() == [
        "  a  bb", "  1  -", "100  x"]
    assert admin_cli.human_bytes(1536) == "1.5 KiB" and admin_cli.human_bytes(None) is None
    assert admin_cli.seconds(59.94) == "59.9s" and admin_cli.seconds(61) == "1m01s"


def justapi(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`justapi ARGS` as a user runs it: a process of its own, through the console script's
    module."""
    return subprocess.run([sys.executable, "-m", "justapi.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_justapi_help_lists_the_ops_commands():
    result = justapi("--help")
    assert result.returncode == 0
    listed = [line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines()
              if line.strip()]
    assert set(OPS_COMMANDS) | {"serve", "generate", "bench"} <= set(listed)


@pytest.mark.parametrize("command", OPS_COMMANDS)
def test_every_command_has_help(command: str):
    result = CliRunner().invoke(cli.main, [command, "--help"])
    assert result.exit_code == 0 and result.output.startswith("Usage: ")
    if command in ADMIN_COMMANDS:
        assert "--admin ENDPOINT" in result.output and "--json" in result.output
        assert "--timeout SECONDS" in result.output


def test_no_server_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "JUSTAPI_STATE_DIR": str(tmp_path)}
    result = justapi("status", env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"justapi status: error: no running justapi server found in {tmp_path} (start one with "
        "`justapi serve`, or pass --admin ENDPOINT)"]
    for command in (["health"], ["flush-cache", "--pool", "0"], ["drain", "0"]):
        result = justapi(*command, "--admin", f"ipc://{tmp_path}/gone.sock", env=env)
        assert result.returncode == 2, command
        assert result.stderr.strip().splitlines() == [
            f"justapi {command[0]}: error: no admin socket at ipc://{tmp_path}/gone.sock "
            "(is the server running?)"]
    result = justapi("status", "--timeout", "0", env=env)
    assert result.returncode == 2 and "timeout_s must be > 0, got 0.0" in result.stderr
    result = justapi("drain", "one", env=env)  # a bad flag value: click's usage error
    assert result.returncode == 2 and "'one' is not a valid integer" in result.stderr


def test_keys_writes_a_pair_and_never_overwrites(tmp_path):
    secret = tmp_path / "server.key"
    result = CliRunner().invoke(cli.main, ["keys", str(secret)])
    assert result.exit_code == 0, result.output
    public = (tmp_path / "server.key.pub").read_text().strip()
    assert result.output.splitlines() == [
        f"secret key: {secret} (mode 0600, for --zmq-curve-secret-key)",
        f"public key: {secret}.pub: {public}"]
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600 and len(read_secret_key(str(secret))) == 40
    again = CliRunner().invoke(cli.main, ["keys", str(secret)])
    assert again.exit_code == 2 and again.stdout == "" and again.stderr.strip() == \
        f"justapi keys: cannot write {secret}: File exists"
    assert len(public) == 40 and (tmp_path / "server.key.pub").read_text().strip() == public


def test_perplexity_bad_text_is_one_line():
    result = CliRunner().invoke(cli.main, ["perplexity", "--text", "/nonexistent/prose.txt"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip() == \
        "justapi perplexity: error: [Errno 2] No such file or directory: '/nonexistent/prose.txt'"


def inspect(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `justapi inspect ARGS`."""
    result = CliRunner().invoke(cli.main, ["inspect", *args])
    return result.exit_code, result.stdout, result.stderr


def test_gguf_info_on_a_tiny_model(tiny_gguf):
    path = tiny_gguf(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=256)
    code, out, _ = inspect(path, "--json", "--seqs", "2")
    assert code == 0
    report = json.loads(out)
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


def test_gguf_info_on_the_default_model(smollm2_path):
    code, text, _ = inspect(smollm2_path, "--tensors")
    assert code == 0
    assert "model  Smollm2 135M" in text and "llama, MOSTLY_Q4_1, 134.5 M parameters" in text
    assert "layers 30, hidden 576, heads 9 (kv 3, head dim 64), ffn 1536, context 8192" in text
    assert "Q4_1      210" in text and "eos 2 '<|im_end|>'" in text
    assert "368 characters (jinja)" in text
    fp32 = next(line for line in text.splitlines() if line.strip().startswith("fp32"))
    assert "513.1 MiB" in fp32 and "45.0 KiB" in fp32 and "360.0 MiB" in fp32
    assert "blk.0.attn_q.weight" in text


def test_gguf_info_bad_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, definitely not" * 3)
    code, out, err = inspect(str(bad))
    assert code == 1 and out == ""
    assert err.strip() == f"justapi inspect: error: {bad}: not a GGUF file (bad magic or too short)"
    code, _, err = inspect(str(bad), "--seqs", "0")
    assert code == 2 and "0 is not in the range x>=1" in err


def test_perplexity_on_a_tiny_model(tiny_gguf, tmp_path):
    """The data plane behind `justapi perplexity`: the same weights twice score the same."""
    path = tiny_gguf(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, context=256)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    result = CliRunner().invoke(cli.main, ["perplexity", "--model", path, "--text", str(text),
                                           "--n-ctx", "64", "--paths", "fp32,fp32"])
    assert result.exit_code == 0, result.output
    header, first, second = result.stdout.splitlines()
    assert header.startswith(f"text {text}; n_ctx 64, stride 32, chunk rows 64; load average ")
    found = re.fullmatch(r" fp32: perplexity +([0-9.]+) \(\+0\.000% vs fp32\), (\d+) tokens "
                         r"scored in (\d+) windows of (\d+), [0-9.]+ s", first)
    assert found, first
    num_scored, num_windows, num_tokens = map(int, found.groups()[1:])
    # a window of 64 every 32 tokens while a whole one fits; each scores its second half
    assert num_windows == (num_tokens - 64) // 32 + 1 and num_scored == 32 * num_windows
    assert second.split()[2] == found.group(1)  # the same weights score the same
