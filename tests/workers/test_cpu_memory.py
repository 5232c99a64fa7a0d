"""CPU processes keep freed heap pages (workers/cpu_memory.py): a decode step of a tiny model at
64 sequences on the gathered attention path took ~990 minor page faults with glibc's default
thresholds and ~3 with them raised. (The CPU attention kernel reads K/V in place, so its decode
steps make few temporaries either way; long chunks and the no-compiler fallback still gather.)
Page faults are counted, not timed: the count does not move with the host's load."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from justapi.config.serve import build_config
from justapi.launch.child import ChildSpec, Endpoints
from workers import link
from workers.cpu_memory import keep_freed_memory

STEPS = r"""
import resource, sys
import numpy as np
import workers.engine
from justapi.wire.protocol import NewRequest, StepPlan
from justapi.sampling import SamplingParams
from workers.weights.synthetic import materialize

if sys.argv[1] == "default-malloc":
    workers.engine.keep_freed_memory = lambda: False
engine = workers.engine.LLMEngine(
    materialize("synthetic:layers=1,hidden=64,heads=4,kv_heads=2,ffn=128,context=2048", sys.argv[2]),
    max_seqs=64, num_blocks=2048, progress=False)
num_seqs, context = 64, 264
ids = [f"r{i}" for i in range(num_seqs)]
per_seq = -(-(context + 1) // 16)
blocks = np.arange(num_seqs * per_seq, dtype=np.int32)
params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
new = [NewRequest(i, params, 16, np.ones(context, np.int32)) for i in ids]

def step(step_id, new_requests):
    engine.runner.execute(StepPlan(
        step_id, ids, np.full(num_seqs, context, np.int32), np.ones(num_seqs, np.int32),
        np.full(num_seqs, 5, np.int32), np.full(num_seqs, per_seq, np.int32), blocks,
        np.ones(num_seqs, bool), new_requests=new_requests))

step(0, new)
for s in range(1, 4):
    step(s, [])
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for s in range(4, 14):
    step(s, [])
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 10)
"""


def faults_per_step(mode: str, cache_dir: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JUSTAPI_CPU_KERNELS": "0"}  # gathered K/V
    out = subprocess.run([sys.executable, "-c", STEPS, mode, cache_dir], capture_output=True,
                         text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def test_decode_steps_stop_faulting_in_fresh_pages(tmp_path):
    if not keep_freed_memory():
        pytest.skip("this C library has no mallopt thresholds")
    default = faults_per_step("default-malloc", str(tmp_path))
    kept = faults_per_step("engine", str(tmp_path))  # LLMEngine on CPU sets the thresholds
    assert kept < 64, f"{kept} page faults per step with the thresholds raised"
    assert default > 10 * kept, (default, kept)  # what the setting is for


def test_cpu_worker_sets_thresholds_gpu_worker_does_not(monkeypatch):
    calls = []
    monkeypatch.setattr(link, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(link.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(link, "require_cuda", lambda device: None)  # no GPU needed to ask
    cpu = ChildSpec("worker", 0, build_config({}, {}), Endpoints.in_dir("/tmp/x"), "")
    assert link.LocalLink().claim_device(cpu) == "cpu"
    assert calls == [1]
    gpu = ChildSpec("worker", 0, build_config({}, {"device": "cuda"}), Endpoints.in_dir("/tmp/x"), "")
    assert link.LocalLink().claim_device(gpu).startswith("cuda")
    assert calls == [1]


TRIM = r"""
from tools.bench.quant import private_mib
from workers.cpu_memory import keep_freed_memory, release_freed_memory

assert keep_freed_memory()
blocks = [bytearray(4 << 20) for _ in range(64)]  # 256 MiB under the mmap threshold: heap
del blocks
kept, _ = private_mib()
assert release_freed_memory()
after, _ = private_mib()
print(kept - after)
"""


def test_release_freed_memory_returns_kept_pages() -> None:
    """What keep_freed_memory keeps (freed 4 MiB blocks), release_freed_memory hands back: a
    load that measured plans does not hold what it timed with."""
    out = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert float(out.stdout.strip()) > 200, out.stdout
