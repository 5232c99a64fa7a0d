"""`python -m tools.bench llama1b`'s capacity run: it reads llama-batched-bench's table, runs
it with the `batch` workload's sizes, bounds the served rate from the two rates, and measures
this engine's prefill and decode at those sizes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tools.bench import llama1b, peer
from tools.harness import TINY_MODEL

TABLE = """main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |   16 |   4096 |   14.261 |   143.61 |   18.279 |   112.05 |   32.540 |   125.86 |

llama_perf_context_print:        load time =     412.66 ms
"""

STAND_IN = f"""#!{sys.executable}
import sys
open({{path!r}}, "w").write(" ".join(sys.argv[1:]))
print({TABLE!r})
"""


def test_the_table_gives_prefill_and_decode_rates():
    assert llama1b.parse_batched_bench(TABLE) == (143.61, 112.05)
    with pytest.raises(ValueError, match="no result table"):
        llama1b.parse_batched_bench("llama_model_load: error loading model\n")


def test_the_bound_is_the_time_a_request_takes_computed():
    assert llama1b.batch_bound(100.0, 100.0, 128, 128) == pytest.approx(50.0)
    # prompt at 200 tok/s (0.64 s), output at 100 (1.28 s): 128 out in 1.92 s
    assert llama1b.batch_bound(200.0, 100.0, 128, 128) == pytest.approx(128 / 1.92)
    assert llama1b.batch_bound(100.0, 100.0, 0, 128) == pytest.approx(100.0)


def test_capacity_has_the_batch_workloads_sizes():
    batch = peer.workloads()["batch"].options
    assert llama1b.CAPACITY == (batch.prompt_tokens, batch.max_tokens, batch.concurrency)


def test_llama_batched_bench_gets_the_sizes_and_threads(tmp_path: Path):
    args_file = tmp_path / "args"
    binary = tmp_path / "llama-batched-bench"
    binary.write_text(STAND_IN.format(path=str(args_file)))
    binary.chmod(0o755)
    assert llama1b.llama_capacity(binary, tmp_path / "m.gguf", 3) == (143.61, 112.05)
    args = args_file.read_text().split()
    flags = dict(zip(args[::2], args[1::2]))
    assert flags == {"-m": str(tmp_path / "m.gguf"), "-t": "3", "-c": "8192", "-npp": "128",
                     "-ntg": "128", "-npl": "16"}


def test_a_build_without_llama_batched_bench_is_one_readable_line(tmp_path: Path):
    with pytest.raises(SystemExit, match="llama-batched-bench is missing"):
        llama1b.llama_capacity(tmp_path / "llama-batched-bench", tmp_path / "m.gguf", 2)


def test_this_engine_measures_both_rates_on_a_tiny_model(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(llama1b, "CAPACITY", (32, 8, 4))
    prefill, decode = llama1b.engine_capacity(Path(TINY_MODEL), 1)
    assert prefill > 0 and decode > 0
