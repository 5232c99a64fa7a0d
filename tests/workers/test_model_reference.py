"""The paged, chunked, batched forward equals a dense reference forward (tests/support/reference_llama.py),
and on SmolLM2 our greedy continuations and logits equal HF transformers'."""
from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from tests.support.reference_llama import ReferenceLlama
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import SHORT_CHUNK_TOKENS, TorchCpuBackend, TorchPagedBackend
from workers.model.forward import (
    Linear,
    DecoderModel,
    has_onednn_bf16,
    has_onednn_linear,
    onednn_rows,
)
from workers.runner import ModelRunner
from workers.weights.gguf_loader import load_weights

BLOCK_SIZE = 4
NUM_BLOCKS = 96
TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module", params=TYPES)
def models(request, tiny_gguf):
    spec = dict(type=request.param, layers=2, vocab=320)
    if request.param.endswith("_K"):
        spec.update(hidden=256, heads=4, kv_heads=2, ffn=256)
    path = tiny_gguf(**spec)
    return DecoderModel(load_weights(GGUFFile(path), progress=False)), ReferenceLlama(path)


def make_runner(model: DecoderModel, chunk_bytes: int | None = None, kernel: bool = False,
                kv_dtype: torch.dtype = torch.float32) -> ModelRunner:
    """Attention by the gathered torch path (all short chunks in one SDPA, or chunk_bytes=1:
    one each), or with kernel=True by the native CPU kernel (workers/model/csrc/paged_attention.c);
    over a pool of kv_dtype (bf16: `--kv-cache-dtype`'s default)."""
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, NUM_BLOCKS, BLOCK_SIZE, p.num_kv_heads, p.head_dim),
                         dtype=kv_dtype)
    if kernel:
        if shutil.which("cc") is None:
            pytest.skip("the CPU attention kernel needs a C compiler")
        backend = TorchCpuBackend(BLOCK_SIZE)
        assert backend.kernel is not None, "the CPU kernel did not build (see the warning)"
        return ModelRunner(model, pool, backend)
    return ModelRunner(model, pool, TorchPagedBackend(BLOCK_SIZE, chunk_bytes=chunk_bytes))


class Seqs:
    """Sequences with fixed random tokens and scattered, interleaved block tables."""

    def __init__(self, lengths: dict[str, int], vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.tokens = {rid: rng.integers(0, vocab, n).tolist() for rid, n in lengths.items()}
        free = rng.permutation(NUM_BLOCKS).tolist()
        self.blocks = {rid: [free.pop() for _ in range(-(-n // BLOCK_SIZE))] for rid, n in lengths.items()}

    def new(self, rid: str) -> NewRequest:
        return NewRequest(rid, GREEDY, len(self.tokens[rid]), np.asarray(self.tokens[rid], np.int32))

    def chunk(self, rid: str, start: int, num: int):
        return (rid, start, self.tokens[rid][start:start + num], self.blocks[rid], True)


def all_row_logits(runner: ModelRunner, step_id: int, chunks, new=()) -> list[torch.Tensor]:
    """Logits of every row of every chunk (drafts = num_tokens - 1 exposes all rows)."""
    plan = StepPlan.build(step_id, chunks, list(new))
    plan = dataclasses.replace(plan, num_draft_tokens=(plan.num_tokens - 1).astype(np.int32))
    logits = runner.forward_logits(plan)
    return list(torch.split(logits, plan.num_tokens.tolist()))


def assert_matches(ours: torch.Tensor, reference: torch.Tensor, tolerance: float = 2e-5) -> None:
    scale = max(1.0, float(reference.abs().max()))
    torch.testing.assert_close(ours, reference, atol=tolerance * scale, rtol=0)


def test_prefill_one_long_chunk(models):
    model, ref = models
    seqs = Seqs({"a": 23}, model.params.vocab_size)
    assert 23 > SHORT_CHUNK_TOKENS
    (logits,) = all_row_logits(make_runner(model), 1, [seqs.chunk("a", 0, 23)], [seqs.new("a")])
    assert_matches(logits, ref.forward(seqs.tokens["a"]))


def test_chunked_prefill_across_steps(models):
    model, ref = models
    seqs = Seqs({"a": 37}, model.params.vocab_size, seed=1)
    runner, expected = make_runner(model), ref.forward(seqs.tokens["a"])
    start = 0
    for step, size in enumerate([7, 18, 1, 11]):  # short, long, single, short chunks
        (logits,) = all_row_logits(runner, step, [seqs.chunk("a", start, size)],
                                   [seqs.new("a")] if step == 0 else [])
        assert_matches(logits, expected[start:start + size])
        start += size


BF16_CACHE_TOLERANCE = 2e-2
"""Of the logits' scale, over a bf16 KV cache: K/V rounded to 8 bits of mantissa moved them by
at most ~2.5e-3 of it here (the fp32 bound, 2e-5, fails there); a wrong key or position moves
them by whole units."""


@pytest.mark.parametrize("chunk_bytes,kernel,kv_dtype", [(None, False, torch.float32), (1, False, torch.float32),
                                                         (None, True, torch.float32), (None, False, torch.bfloat16),
                                                         (None, True, torch.bfloat16)],
                         ids=["one-sdpa", "sdpa-each", "cpu-kernel", "one-sdpa-bf16-cache", "cpu-kernel-bf16-cache"])
def test_mixed_batches_decoding_across_block_boundaries(models, chunk_bytes, kernel, kv_dtype):
    """One step mixes a long prefill, short chunks and decodes of sequences of other lengths;
    then all decode together (teacher-forced) across block boundaries, while a late sequence
    prefills in the middle of the decodes. Over a bf16 cache within BF16_CACHE_TOLERANCE."""
    model, ref = models
    lengths = {"a": 3 + 10, "b": 18 + 10, "c": 9 + 10, "d": 21 + 5}
    seqs = Seqs(lengths, model.params.vocab_size, seed=2)
    runner = make_runner(model, chunk_bytes, kernel, kv_dtype)
    tolerance = 2e-5 if kv_dtype == torch.float32 else BF16_CACHE_TOLERANCE
    expected = {rid: ref.forward(tokens) for rid, tokens in seqs.tokens.items()}
    prompt = {"a": 3, "b": 18, "c": 9}
    got = all_row_logits(runner, 0, [seqs.chunk(r, 0, n) for r, n in prompt.items()],
                         [seqs.new(r) for r in prompt])
    for (rid, n), logits in zip(prompt.items(), got):
        assert_matches(logits, expected[rid][:n], tolerance)
    for step in range(10):
        chunks = [seqs.chunk(rid, n + step, 1) for rid, n in prompt.items()]
        new = []
        if step == 4:  # a 21-token prefill joins the decodes
            chunks.insert(1, seqs.chunk("d", 0, 21))
            new = [seqs.new("d")]
        elif step > 4:
            chunks.append(seqs.chunk("d", 21 + step - 5, 1))
        got = all_row_logits(runner, 1 + step, chunks, new)
        for (rid, start, tokens, _, _), logits in zip(chunks, got):
            assert_matches(logits, expected[rid][start:start + len(tokens)], tolerance)


def test_runner_samples_the_reference_argmax(models):
    model, ref = models
    seqs = Seqs({"a": 6, "b": 17}, model.params.vocab_size, seed=3)
    result = make_runner(model).execute(StepPlan.build(
        1, [seqs.chunk("a", 0, 6), seqs.chunk("b", 0, 17)], [seqs.new("a"), seqs.new("b")]))
    want = [int(ref.forward(seqs.tokens[r])[-1].argmax()) for r in ("a", "b")]
    assert result.sampled_token_ids.tolist() == want


@pytest.mark.parametrize("rows", [1, 2, 16, 17, 33, 70, 300])
def test_linear_kernels_equal_a_plain_matmul(rows):
    torch.manual_seed(rows)
    w, x = torch.randn(96, 64), torch.randn(rows, 64)
    fast = Linear(w)
    assert fast.is_onednn == has_onednn_linear()
    torch.testing.assert_close(fast(x), x @ w.T, atol=1e-5, rtol=1e-5)
    dense = Linear(w.to(torch.bfloat16))  # not fp32: the plain path GPUs take
    assert not dense.is_onednn
    torch.testing.assert_close(dense(x.to(torch.bfloat16)).float(), x @ w.T, atol=0.2, rtol=0.05)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_a_row_comes_out_alike_at_every_batch_size(compute_dtype):
    """Bit for bit: one row (a lone decode), a few, or hundreds (SmolLM2's shapes). Else a
    request's tokens would depend on its batch mates, and speculative verification (many rows)
    on what plain decoding (one row) computed."""
    if compute_dtype is not None and not has_onednn_bf16():
        pytest.skip("oneDNN has no bf16 kernels here")
    torch.manual_seed(0)
    for out_features, in_features in ((1536, 576), (576, 1536), (2048, 576)):
        linear = Linear(torch.randn(out_features, in_features), compute_dtype)
        x = torch.randn(300, in_features)
        first_rows = {m: linear(x[:m])[0] for m in (1, 2, 3, 16, 17, 64, 65, 300)}
        for m, row in first_rows.items():
            assert torch.equal(row, first_rows[2]), (out_features, in_features, m)


@pytest.fixture(scope="module")
def q4_model(tiny_gguf):
    path = tiny_gguf(type="Q4_1", layers=2, hidden=128, heads=4, kv_heads=2, ffn=1536, vocab=320)
    return DecoderModel(load_weights(GGUFFile(path), progress=False))


def last_token_logits(runner: ModelRunner, seqs: Seqs, rids: list[str], step: int) -> torch.Tensor:
    """Prefill all but the last token of each sequence, decode the last one in one step
    together, then free them; the first sequence's logits."""
    prefill = [(r, 0, seqs.tokens[r][:-1], seqs.blocks[r], False) for r in rids]
    runner.execute(StepPlan.build(step, prefill, [seqs.new(r) for r in rids]))
    last = [(r, len(seqs.tokens[r]) - 1, seqs.tokens[r][-1:], seqs.blocks[r], True) for r in rids]
    logits = runner.forward_logits(StepPlan.build(step + 1, last))
    runner.execute(StepPlan.build(step + 2, [], finished_request_ids=rids))
    return logits[0]


def test_a_decoding_sequence_gets_the_same_logits_alone_or_batched(q4_model):
    """The whole step, fp32, gathered attention: the logits of one decoding sequence are
    bit-identical alone and beside four others (each fix is needed: the one-row matmul and the
    one-sequence SDPA). Batch mates of the same length: a longer mate pads the keys, which
    moves SDPA's last bits (~1e-6 in the logits; docs/quantization.md)."""
    seqs = Seqs({f"s{i}": 9 for i in range(5)}, q4_model.params.vocab_size, seed=5)
    runner = make_runner(q4_model)
    alone = last_token_logits(runner, seqs, ["s0"], 1)
    batched = last_token_logits(runner, seqs, list(seqs.tokens), 10)
    assert torch.equal(alone, batched), float((alone - batched).abs().max())


def test_with_the_cpu_kernel_a_decode_is_bit_identical_beside_longer_mates(q4_model):
    """What the gathered path cannot give (longer mates pad its keys): the logits of one
    decoding sequence are the same bits alone and beside sequences of other lengths."""
    seqs = Seqs({"s0": 9, "s1": 30, "s2": 17, "s3": 5}, q4_model.params.vocab_size, seed=6)
    runner = make_runner(q4_model, kernel=True)
    alone = last_token_logits(runner, seqs, ["s0"], 1)
    assert torch.equal(alone, last_token_logits(runner, seqs, list(seqs.tokens), 10))


def test_with_the_cpu_kernel_verification_rows_are_bit_identical_to_plain_decoding(q4_model):
    """Speculative verification computes k + 1 rows of a sequence in one step; with the kernel
    each row's logits are the bits plain decoding gets for that position, one token a step."""
    seqs = Seqs({"a": 20}, q4_model.params.vocab_size, seed=7)
    tokens, prompt = seqs.tokens["a"], 14

    def run(chunk_sizes: list[int]) -> torch.Tensor:
        runner = make_runner(q4_model, kernel=True)
        rows, start = [], prompt
        runner.execute(StepPlan.build(0, [seqs.chunk("a", 0, prompt)[:4] + (False,)], [seqs.new("a")]))
        for step, size in enumerate(chunk_sizes, 1):
            (logits,) = all_row_logits(runner, step, [seqs.chunk("a", start, size)])
            rows.append(logits)
            start += size
        return torch.cat(rows)

    one_at_a_time = run([1] * 6)
    verified = run([1, 5])  # one decode, then a 5-row verification chunk
    assert torch.equal(one_at_a_time, verified), float((one_at_a_time - verified).abs().max())


def test_onednn_row_buckets_are_few_and_cover_every_size():
    buckets = [onednn_rows(m) for m in range(1, 4097)]
    assert all(b >= m for m, b in zip(range(1, 4097), buckets))
    assert all(b <= m * 1.25 for m, b in zip(range(65, 4097), buckets))  # bounded padding
    assert len(set(buckets)) <= 60  # few shapes: oneDNN keeps buffers per shape


# ------------------------------------------------------------------------------ SmolLM2 vs HF

PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
           "Water boils at a temperature of", "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]
NUM_NEW = 32


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    directory, name = os.path.split(smollm2_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def our_engine(smollm2_path):
    from workers.engine import LLMEngine

    engine = LLMEngine(smollm2_path, progress=False, max_seqs=8, num_blocks=256)
    yield engine
    engine.close()


def hf_greedy(model, prompt_ids: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with HF's own KV cache; returns tokens and the prompt's last logits."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        first_logits = out.logits[0, -1].clone()
        tokens = []
        for _ in range(num_new):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, first_logits


@pytest.mark.slow
def test_smollm2_greedy_and_logits_equal_hf(hf_model, our_engine):
    model, tokenizer = hf_model
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ours = our_engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=NUM_NEW,
                                                          ignore_eos=True))
    runner = our_engine.runner
    for i, ids in enumerate(prompt_ids):
        want, hf_logits = hf_greedy(model, ids, NUM_NEW)
        assert ours[i].token_ids == want, PROMPTS[i]
        plan = StepPlan.build(100 + i, [(f"hf-{i}", 0, ids, list(range(-(-len(ids) // 16))), True)],
                              [NewRequest(f"hf-{i}", GREEDY, len(ids), np.asarray(ids, np.int32))],
                              )
        logits = runner.forward_logits(plan)[0]
        runner.requests.pop(f"hf-{i}")
        torch.testing.assert_close(logits, hf_logits, atol=2e-3, rtol=0)
