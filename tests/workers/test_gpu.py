"""The CUDA paths, on a machine with a GPU (skipped elsewhere): the Triton attention kernel
against a float64 reference, the bf16 paged forward (the in-place Triton attention, and the
gathered path) against the dense fp32 reference, greedy
output with and without CUDA graphs, a graphed decode step synchronizing once (its sampled
ids), sampling on the device, a KV pool shared between two
processes through a CUDA IPC handle, speculative decoding's greedy identity on the GPU, and
`justapi serve --gpu` end to end (its outputs equal the in-process GPU engine's, NVML figures
reach /metrics, SIGTERM leaves nothing behind). JUSTAPI_TEST_GPU_DEVICE=cpu runs the file on
a CPU (a dry run of tools/gpu_check.sh: Triton's interpreter stands in for the GPU kernels,
plain calls for the graphs)."""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tests.workers.test_model_reference import BLOCK_SIZE, NUM_BLOCKS, Seqs, all_row_logits

from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from tests.support.chi_square import goodness_of_fit
from tests.support.reference_llama import ReferenceLlama
from tools.harness import TINY_MODEL, ServedPool
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import AttentionBackend
from workers.model.backends import make_backend
from workers.model.forward import DecoderModel
from workers.runner import ModelRunner
from workers.sampler import Sampler, SamplingRow, filtered_probs
from workers.weights.gguf_loader import load_weights
from workers.weights.hparams import HyperParams

DEVICE = os.environ.get("JUSTAPI_TEST_GPU_DEVICE", "cuda")
"""'cpu' runs these same paths on the CPU (a dry run of the file on a machine without a GPU)."""
ON_GPU = DEVICE != "cpu"
pytestmark = pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
KIND = "cuda_ipc" if ON_GPU else "shm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "abc abc abc abc abc abc", "Once upon a time"]


def attention_backend(p: HyperParams, gathered: bool) -> AttentionBackend:
    """The GPU's backend: in-place Triton kernels, or the gathered blocks; on a CPU dry run the
    Triton kernels in Triton's interpreter (tests/conftest.py sets it), or the CPU backend."""
    heads = (p.num_heads, p.num_kv_heads, p.head_dim)
    if ON_GPU or gathered:
        return make_backend(DEVICE, BLOCK_SIZE, heads, gathered=gathered)
    from workers.model.paged_backend import triton_backend
    backend = triton_backend("cpu", BLOCK_SIZE, *heads)
    assert backend is not None, "the dry run needs Triton"
    return backend


@pytest.mark.parametrize("attention", ["paged", "gathered"])
@pytest.mark.parametrize("qtype", ["F16", "Q4_1", "Q8_0"])
def test_bf16_paged_forward_on_cuda_matches_the_fp32_reference(tiny_gguf, qtype, attention):
    path = tiny_gguf(type=qtype, layers=2, vocab=320)
    model = DecoderModel(load_weights(GGUFFile(path), device=DEVICE, dtype=DTYPE, progress=False))
    reference = ReferenceLlama(path)
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, NUM_BLOCKS, BLOCK_SIZE, p.num_kv_heads, p.head_dim),
                         "local" if ON_GPU else "shm", DTYPE, DEVICE)
    backend = attention_backend(p, gathered=attention == "gathered")
    assert (type(backend).__name__ == "TritonPagedBackend") == (attention == "paged")
    runner = ModelRunner(model, pool, backend)
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


@pytest.mark.parametrize("half", [True, False, "f16 pool"], ids=["half", "fp32", "f16-pool"])
def test_paged_attention_kernel_on_the_device_matches_a_float64_reference(half):
    """The Triton kernel compiled for the device (on a CPU dry run: interpreted) on a mixed
    step over scattered blocks with a token tree, GQA groups of 4, plain and with a window and
    soft-capping: bf16 (fp16 on the CPU, whose interpreter has no bf16) and fp32 inputs, and
    bf16 queries over an f16 pool (--kv-cache-dtype float16 on a GPU)."""
    from tests.workers.test_cpu_kernels import random_step
    from tests.workers.test_triton_attention import reference
    from workers.model.paged_backend import TritonPagedBackend
    from workers.model.triton_attention import AttentionParams
    from workers.spec.tree import TreeLayout, verify_mask

    dtype = (torch.bfloat16 if ON_GPU else torch.float16) if half else torch.float32
    tree = TreeLayout()
    tree.add(verify_mask(seq=2, num_tokens=6, start=40, parents=[-1, 0, 0, 1, 2]))
    batch, kv, q = random_step([0, 15, 40, 9, 100], [1, 1, 6, 30, 1], 8, 2, 64, 16, seed=6, tree=tree)
    kv, q = kv.to(dtype), q.to(dtype)
    if half == "f16 pool":
        kv, q = kv.half(), q.bfloat16()
    for params in (AttentionParams(64 ** -0.5), AttentionParams(0.1, window=20, softcap=3.0)):
        backend = TritonPagedBackend(16, DEVICE, 4, params)
        got = backend.attend(kv.to(DEVICE), q.to(DEVICE), backend.prepare(batch)).double().cpu()
        want = reference(batch, kv.float(), q.float(), params)
        error = float((got - want).abs().max() / want.abs().max())
        assert error < (2e-2 if half else 1e-5), (params, error)


def test_greedy_output_is_the_same_with_and_without_cuda_graphs(tiny_gguf):
    """Decode steps replayed from graphs (padded to their batch bucket) against the same steps
    launched kernel by kernel (--no-cuda-graphs): token for token."""
    from workers.engine import LLMEngine

    path = tiny_gguf(layers=2, vocab=384)
    outputs, replayed = {}, {}
    for use_graphs in (True, False):
        engine = LLMEngine(path, device=DEVICE, progress=False, num_blocks=256, max_seqs=8,
                           cuda_graphs=use_graphs)
        assert (engine.graphs is not None) == ON_GPU
        if engine.graphs is not None:
            assert len(engine.graphs.graphs) == 4  # batch buckets 1, 2, 4, 8
            assert (engine.graphs.report.memory_bytes > 0) == use_graphs
            replayed[use_graphs] = _count_graph_steps(engine)
        outputs[use_graphs] = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        engine.close()
    assert outputs[True] == outputs[False]
    if ON_GPU:
        assert replayed[True] and replayed[True] == replayed[False]  # decodes took the graph path


@pytest.mark.skipif(not ON_GPU, reason="counts CUDA synchronizations")
def test_a_graphed_decode_step_reads_back_only_its_sampled_ids(tiny_gguf):
    """Under torch's sync debug mode a decode step (replayed graph, a constrained row's packed
    bitmask applied on the device, greedy and sampled rows) synchronizes once: the ids' copy."""
    import warnings

    from justapi.wire.protocol import NewRequest, StepPlan
    from workers.engine import LLMEngine

    engine = LLMEngine(tiny_gguf(layers=2, vocab=384), device=DEVICE, progress=False, num_blocks=64, max_seqs=4)
    runner = engine.runner
    new = [NewRequest("a", GREEDY, 5, np.array([5, 6, 7, 8, 9], np.int32)),
           NewRequest("b", SamplingParams(temperature=0.8, max_tokens=4), 2, np.array([3, 4], np.int32))]
    runner.execute(StepPlan.build(1, [("a", 0, [5, 6, 7, 8, 9], [0], True), ("b", 0, [3, 4], [1], True)], new))
    decode = StepPlan.build(2, [("a", 5, [11], [0], True), ("b", 2, [12], [1], True)])
    mask = np.full((1, 12), -1, np.int32)
    mask[0, 0] = 0  # tokens 0..31 forbidden to row 0
    decode = dataclasses.replace(decode, bitmask_rows=np.array([0], np.int32), token_bitmask=mask)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = runner.execute(decode)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert result.sampled_token_ids[0] >= 32  # the mask held
    engine.close()


def _count_graph_steps(engine) -> list[int]:
    """Steps the engine's graphs computed: a list that grows as they do."""
    graphs, counted = engine.graphs, []
    run = graphs.run

    def counting(*args):
        logits = run(*args)
        if logits is not None:
            counted.append(1)
        return logits
    graphs.run = counting
    return counted


def test_sampling_on_the_device_follows_the_filtered_distribution():
    """Unseeded rows drawn on the device (its own generator) follow temperature, min_p, top_k
    and top_p; seeded rows, penalties, logit_bias and logprobs give the CPU's results."""
    logits = torch.tensor([[1.5, 0.2, -0.3, 2.0, 0.9, -1.0, 0.0, 1.1, -2.0, 0.5]])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, min_p=0.05)
    num = 20000
    rows = [SamplingRow(params, np.zeros(0, np.int64), 0, i) for i in range(num)]
    drawn = Sampler(seed=1).sample(logits.to(DEVICE).expand(num, -1), rows).token_ids
    want = filtered_probs(logits, [params])[0].double().numpy()
    assert goodness_of_fit(drawn.tolist(), dict(enumerate(want))) > 1e-4
    special = [SamplingParams(temperature=0.9, seed=7, logprobs=3),
               SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                              logit_bias=((2, 3.0),), logprobs=2),
               SamplingParams(temperature=1.2, top_p=0.5, seed=11, presence_penalty=0.4)]
    history = np.asarray([3, 0, 3, 7], np.int64)
    special_rows = [SamplingRow(p, history, 2, 9) for p in special]
    batch = torch.randn(3, 10, generator=torch.Generator().manual_seed(2)) * 2
    on_device = Sampler(seed=3).sample(batch.to(DEVICE), special_rows)
    on_cpu = Sampler(seed=3).sample(batch, special_rows)
    assert on_device.token_ids.tolist() == on_cpu.token_ids.tolist()
    assert on_device.top_ids.tolist() == on_cpu.top_ids.tolist()
    np.testing.assert_allclose(on_device.logprobs, on_cpu.logprobs, atol=1e-5)


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
