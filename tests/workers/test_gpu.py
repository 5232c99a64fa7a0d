"""The CUDA paths, on a machine with a GPU (skipped elsewhere): the bf16 paged forward on the
CUDA backend against the dense fp32 reference, a KV pool shared between two processes through
a CUDA IPC handle, speculative decoding's greedy identity on the GPU, and `justapi serve --gpu`
end to end (its outputs equal the in-process GPU engine's, NVML figures reach /metrics, SIGTERM
leaves nothing behind)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tests.workers.test_model_reference import BLOCK_SIZE, NUM_BLOCKS, Seqs, all_row_logits

from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from tests.support.reference_llama import ReferenceLlama
from tools.harness import TINY_MODEL, ServedPool
from workers.kv.pool import KVPool, PoolShape
from workers.model.backends import make_backend
from workers.model.forward import LlamaModel
from workers.runner import ModelRunner
from workers.weights.gguf_loader import load_llama

DEVICE = os.environ.get("JUSTAPI_TEST_GPU_DEVICE", "cuda")
"""'cpu' runs these same paths on the CPU (a dry run of the file on a machine without a GPU)."""
ON_GPU = DEVICE != "cpu"
pytestmark = pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
KIND = "cuda_ipc" if ON_GPU else "shm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "abc abc abc abc abc abc", "Once upon a time"]


@pytest.mark.parametrize("qtype", ["F16", "Q4_1", "Q8_0"])
def test_bf16_paged_forward_on_cuda_matches_the_fp32_reference(tiny_gguf, qtype):
    path = tiny_gguf(type=qtype, layers=2, vocab=320)
    model = LlamaModel(load_llama(GGUFFile(path), device=DEVICE, dtype=DTYPE, progress=False))
    reference = ReferenceLlama(path)
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, NUM_BLOCKS, BLOCK_SIZE, p.num_kv_heads, p.head_dim),
                         "local" if ON_GPU else "shm", DTYPE, DEVICE)
    runner = ModelRunner(model, pool, make_backend(DEVICE, BLOCK_SIZE))
    seqs = Seqs({"a": 37, "b": 5, "c": 64}, vocab=320, seed=3)
    # one step mixes a long prefill, a short prompt and a chunk; the next continues a chunked prefill
    first = all_row_logits(runner, 1, [seqs.chunk("a", 0, 37), seqs.chunk("b", 0, 5),
                                       seqs.chunk("c", 0, 40)],
                           [seqs.new("a"), seqs.new("b"), seqs.new("c")])
    second = all_row_logits(runner, 2, [seqs.chunk("c", 40, 24)])
    ours = {"a": first[0], "b": first[1], "c": torch.cat([first[2], second[0]])}
    for rid, logits in ours.items():
        want = reference.forward(seqs.tokens[rid])
        got = logits.float().cpu()
        scale = float(want.abs().max())
        # bf16 weights and activations: ~3 significant digits per op, a few layers deep
        assert float((got - want).abs().max()) <= 0.05 * scale, rid
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale  # rows whose argmax bf16 cannot flip
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), rid


def _pool_owner(shape: tuple, to_parent, from_parent) -> None:
    pool = KVPool.create(PoolShape(*shape), KIND, DTYPE, DEVICE)
    pool.tensor.fill_(1.5)
    info = pool.info()
    to_parent.put((info.kind, info.handle, info.device, info.dtype, info.pool_id))
    from_parent.get(timeout=120)  # the parent wrote through its mapping
    to_parent.put(float(pool.tensor[0, 1, 3].float().mean()))
    from_parent.get(timeout=120)


def test_kv_pool_is_shared_between_processes_through_a_cuda_ipc_handle():
    from justapi.wire.protocol import PoolInfo

    shape = (2, 8, 4, 2, 16)
    ctx = multiprocessing.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_pool_owner, args=(shape, to_parent, from_parent))
    owner.start()
    try:
        kind, handle, device, dtype, pool_id = to_parent.get(timeout=120)
        assert kind == KIND
        s = PoolShape(*shape)
        info = PoolInfo(pool_id=pool_id, kind=kind, handle=handle, device=device, dtype=dtype,
                        num_layers=s.num_layers, num_blocks=s.num_blocks, block_size=s.block_size,
                        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim)
        pool = KVPool.attach(info)
        assert pool.tensor.is_cuda == ON_GPU and float(pool.tensor.float().mean()) == 1.5  # the owner's data
        pool.tensor[0, 1, 3] = 7.0
        if ON_GPU:
            torch.cuda.synchronize()
        from_parent.put("written")
        assert to_parent.get(timeout=120) == 7.0  # the owner sees our write: one memory
        pool.close()
    finally:
        from_parent.put("done")
        owner.join(60)
    assert owner.exitcode == 0


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_speculative_greedy_output_on_cuda_equals_plain_decoding(tiny_gguf, spec):
    from justapi.config.spec import SpecConfig
    from workers.engine import LLMEngine

    path = tiny_gguf(layers=2, vocab=384)
    plain = LLMEngine(path, device=DEVICE, progress=False, num_blocks=256)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    plain.close()
    config = SpecConfig(spec="ngram", gamma=3, branch=2) if spec == "ngram" else \
        SpecConfig(draft_model=path, spec_tree="2,2")
    engine = LLMEngine(path, device=DEVICE, progress=False, num_blocks=256, speculative=config)
    got = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    engine.close()
    assert got == want


def _metrics(pool: ServedPool) -> dict[str, float]:
    text = httpx.get(f"{pool.base_url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_justapi_serve_on_the_gpu_equals_the_gpu_engine_and_reports_nvml():
    from workers.engine import LLMEngine

    engine = LLMEngine(TINY_MODEL, device=DEVICE, progress=False, num_blocks=256)
    want = [o.text for o in engine.generate(PROMPTS, GREEDY)]
    engine.close()
    pool = ServedPool("--model", TINY_MODEL, *(["--gpu"] if ON_GPU else []), "--pool-blocks", "256", "--log-level", "warning")
    try:
        got = []
        for prompt in PROMPTS:
            reply = httpx.post(f"{pool.base_url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0})
            assert reply.status_code == 200, reply.text
            got.append(reply.json()["choices"][0]["text"])
        assert got == want
        health = httpx.get(f"{pool.base_url}/health", timeout=30)
        assert health.status_code == 200, health.text
        deadline_metrics: dict[str, float] = {}
        for _ in range(20 if ON_GPU else 0):  # NVML readings arrive with the scheduler's periodic statistics
            deadline_metrics = _metrics(pool)
            if "justapi:gpu_memory_total_bytes" in deadline_metrics:
                break
            time.sleep(0.5)
        if ON_GPU:
            assert deadline_metrics.get("justapi:gpu_memory_total_bytes", 0) > 0, sorted(deadline_metrics)
    finally:
        assert pool.stop(signal.SIGTERM) == 0, pool.log()
    assert pool.leftovers() == []
