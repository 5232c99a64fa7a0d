"""Every architecture we serve, on tiny random HF transformers models written to GGUF in
llama.cpp's layout (tests/support/hf_gguf.py), F32 and Q8_0: our logits equal transformers'
for prefill, chunked prefill, batched decoding across blocks (both CPU attention paths) and
our greedy tokens equal its for 32 tokens. Windows (8) are shorter than the sequences, so
sliding-window layers are exercised; MoE tokens pick different experts."""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFError, GGUFFile
from justapi.model.info import ModelInfo
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from tests.support.hf_gguf import hf_greedy, hf_logits, tiny_hf_model, write_gguf
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import TorchCpuBackend, TorchPagedBackend
from workers.model.ffn import MoeFfn
from workers.model.forward import DecoderModel
from workers.runner import ModelRunner
from workers.weights.block_kernels import block_kernels
from workers.weights.block_linear import BlockLinear, StackLinear
from workers.weights.block_matrix import BlockMatrix
from workers.weights.gguf_loader import load_weights
from workers.weights.path_plan import PathPlan
from workers.weights.paths import load_model

pytest.importorskip("transformers")

BLOCK_SIZE = 4
NUM_BLOCKS = 96
WINDOW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "llama": dict(model_type="llama", attention_bias=True),  # biases on q/k/v/o, q/k permuted
    "llama3-rope": dict(model_type="llama", rope_parameters=LLAMA3_ROPE),
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(model_type="qwen2"),
    "qwen2moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "qwen3": dict(model_type="qwen3", head_dim=24),
    "qwen3moe": dict(model_type="qwen3_moe", head_dim=24, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True),
    "gemma2": dict(model_type="gemma2", head_dim=24, query_pre_attn_scalar=24, sliding_window=WINDOW),
    "gemma3": dict(model_type="gemma3_text", head_dim=24, query_pre_attn_scalar=24,
                   sliding_window=WINDOW, num_hidden_layers=6),  # layers 0-4 local, 5 global
    "phi3": dict(model_type="phi3", sliding_window=None,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}),
}
TYPES = ["F32", "Q8_0"]


@dataclasses.dataclass
class Pair:
    hf: object
    ours: DecoderModel
    path: str


@pytest.fixture(scope="module", params=[(c, t) for c in CASES for t in TYPES],
                ids=[f"{c}-{t}" for c in CASES for t in TYPES])
def pair(request, tmp_path_factory) -> Pair:
    case, qtype = request.param
    fields = dict(CASES[case])
    hf = tiny_hf_model(fields.pop("model_type"), seed=len(case), **fields)
    path = str(tmp_path_factory.mktemp("arch") / f"{case}-{qtype}.gguf")
    write_gguf(hf, path, qtype, sliding_window=WINDOW if case == "mistral" else None)
    return Pair(hf, DecoderModel(load_weights(GGUFFile(path), progress=False)), path)


def make_runner(model: DecoderModel, kernel: bool = False) -> ModelRunner:
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, NUM_BLOCKS, BLOCK_SIZE, p.num_kv_heads, p.head_dim))
    if kernel:
        if shutil.which("cc") is None:
            pytest.skip("the CPU attention kernel needs a C compiler")
        backend = TorchCpuBackend(BLOCK_SIZE)
        assert backend.kernel is not None, "the CPU kernel did not build (see the warning)"
        return ModelRunner(model, pool, backend)
    return ModelRunner(model, pool, TorchPagedBackend(BLOCK_SIZE))


class Seqs:
    """Sequences of random tokens with scattered block tables."""

    def __init__(self, lengths: dict[str, int], vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.tokens = {rid: rng.integers(3, vocab, n).tolist() for rid, n in lengths.items()}
        free = rng.permutation(NUM_BLOCKS).tolist()
        self.blocks = {rid: [free.pop() for _ in range(-(-n // BLOCK_SIZE))] for rid, n in lengths.items()}

    def new(self, rid: str) -> NewRequest:
        return NewRequest(rid, GREEDY, len(self.tokens[rid]), np.asarray(self.tokens[rid], np.int32))

    def chunk(self, rid: str, start: int, num: int):
        return (rid, start, self.tokens[rid][start:start + num], self.blocks[rid], True)


def all_row_logits(runner: ModelRunner, step_id: int, chunks, new=()) -> list[torch.Tensor]:
    plan = StepPlan.build(step_id, chunks, list(new))
    plan = dataclasses.replace(plan, num_draft_tokens=(plan.num_tokens - 1).astype(np.int32))
    return list(torch.split(runner.forward_logits(plan), plan.num_tokens.tolist()))


def assert_matches(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = max(1.0, float(reference.abs().max()))
    torch.testing.assert_close(ours, reference, atol=2e-5 * scale, rtol=0)


def test_prefill_and_chunked_prefill_equal_transformers(pair):
    seqs = Seqs({"a": 37}, pair.ours.params.vocab_size, seed=1)
    expected = hf_logits(pair.hf, seqs.tokens["a"])
    (whole,) = all_row_logits(make_runner(pair.ours), 0, [seqs.chunk("a", 0, 37)], [seqs.new("a")])
    assert_matches(whole, expected)
    runner, start = make_runner(pair.ours), 0
    for step, size in enumerate([7, 18, 1, 11]):  # short, long, single, short chunks
        (logits,) = all_row_logits(runner, step, [seqs.chunk("a", start, size)],
                                   [seqs.new("a")] if step == 0 else [])
        assert_matches(logits, expected[start:start + size])
        start += size


@pytest.mark.parametrize("kernel", [False, True], ids=["sdpa", "cpu-kernel"])
def test_batched_decoding_across_blocks_equals_transformers(pair, kernel):
    """A prefill and short chunks of other lengths in one step, then decodes together across
    block boundaries (and past the window) while another sequence prefills midway."""
    lengths = {"a": 3 + 10, "b": 18 + 10, "c": 9 + 10, "d": 21 + 5}
    seqs = Seqs(lengths, pair.ours.params.vocab_size, seed=2)
    runner = make_runner(pair.ours, kernel)
    expected = {rid: hf_logits(pair.hf, tokens) for rid, tokens in seqs.tokens.items()}
    prompt = {"a": 3, "b": 18, "c": 9}
    got = all_row_logits(runner, 0, [seqs.chunk(r, 0, n) for r, n in prompt.items()],
                         [seqs.new(r) for r in prompt])
    for (rid, n), logits in zip(prompt.items(), got):
        assert_matches(logits, expected[rid][:n])
    for step in range(10):
        chunks = [seqs.chunk(rid, n + step, 1) for rid, n in prompt.items()]
        new = []
        if step == 4:
            chunks.insert(1, seqs.chunk("d", 0, 21))
            new = [seqs.new("d")]
        elif step > 4:
            chunks.append(seqs.chunk("d", 21 + step - 5, 1))
        for (rid, start, tokens, _, _), logits in zip(chunks, all_row_logits(runner, 1 + step, chunks, new)):
            assert_matches(logits, expected[rid][start:start + len(tokens)])


def test_greedy_tokens_equal_transformers(pair):
    """32 greedy tokens after a 12-token prompt, one decode step per token (CPU kernel)."""
    prompt = Seqs({"g": 12}, pair.ours.params.vocab_size, seed=3).tokens["g"]
    runner, tokens = make_runner(pair.ours, kernel=shutil.which("cc") is not None), list(prompt)
    table = list(range(-(-(12 + 32) // BLOCK_SIZE)))
    new = [NewRequest("g", GREEDY, 12, np.asarray(prompt, np.int32))]
    chunk = ("g", 0, prompt, table, True)
    for step in range(32):
        tokens.append(int(runner.execute(StepPlan.build(step, [chunk], new)).sampled_token_ids[0]))
        chunk, new = ("g", len(tokens) - 1, tokens[-1:], table, True), []
    assert tokens[12:] == hf_greedy(pair.hf, prompt, 32)


def block_matrices(model: DecoderModel) -> list[BlockMatrix]:
    """Every matrix a model keeps as GGUF blocks (experts, head and embedding included), once."""
    linears = [lin for layer in model.layers for lin in layer.linears()] + [model.output]
    parts = [p for lin in linears for p in (lin.parts if isinstance(lin, StackLinear) else [lin])]
    found = [p.matrix for p in parts if isinstance(p, BlockLinear)]
    found += [model.token_embd] if isinstance(model.token_embd, BlockMatrix) else []
    return list({id(m): m for m in found}.values())


def test_auto_keeps_the_files_blocks_and_computes_what_fp32_does(pair):
    """`--weights auto` on every architecture: each quantized matrix (experts, fused rows, head)
    stays the file's blocks byte for byte, with no dense copy, and a prefill's logits equal the
    fp32 model's (the dense tile decodes each block exactly; only the sums' order differs)."""
    if pair.path.endswith("-F32.gguf"):
        pytest.skip("an F32 file has no blocks to keep")
    if block_kernels() is None:
        pytest.skip("no C compiler: block kernels unavailable")
    gguf = GGUFFile(pair.path)
    auto = load_model(gguf, weights="auto", progress=False, plan=PathPlan.only("dense"))
    quantized = [t for t in gguf.reader.tensors if t.tensor_type.name == "Q8_0"]
    assert quantized and sum(m.raw.numel() for m in block_matrices(auto)) == \
        sum(int(t.n_bytes) for t in quantized)
    seqs = Seqs({"a": 21}, auto.params.vocab_size, seed=6)
    chunk, new = [seqs.chunk("a", 0, 21)], [seqs.new("a")]
    (ours,) = all_row_logits(make_runner(auto), 0, chunk, new)
    (fp32,) = all_row_logits(make_runner(pair.ours), 0, chunk, new)
    assert_matches(ours, fp32)


@pytest.mark.parametrize("case", ["mixtral", "qwen2moe", "qwen3moe"])
def test_moe_tokens_pick_different_experts(case, tmp_path, monkeypatch):
    """The router's choices differ between tokens, and every expert used runs once per layer
    over all of its rows (not once per token)."""
    fields = dict(CASES[case])
    hf = tiny_hf_model(fields.pop("model_type"), seed=5, **fields)
    model = DecoderModel(load_weights(GGUFFile(write_gguf(hf, str(tmp_path / "moe.gguf"))), progress=False))
    chosen, calls = [], []
    route = MoeFfn.route

    def spy(self, x):
        experts, weights = route(self, x)
        chosen.append(experts)
        return experts, weights

    monkeypatch.setattr(MoeFfn, "route", spy)
    for ffn in (layer.ffn for layer in model.layers):
        assert isinstance(ffn, MoeFfn)
        for expert in ffn.experts:  # count the rows of each expert's down projection call
            expert.down = lambda x, down=expert.down: calls.append(x.shape[0]) or down(x)
    seqs = Seqs({"a": 20}, model.params.vocab_size, seed=4)
    (logits,) = all_row_logits(make_runner(model), 0, [seqs.chunk("a", 0, 20)], [seqs.new("a")])
    assert_matches(logits, hf_logits(hf, seqs.tokens["a"]))
    for experts in chosen:  # [20, 2] per layer
        assert len({tuple(sorted(row)) for row in experts.tolist()}) > 1
        assert len(set(experts.reshape(-1).tolist())) > model.params.num_experts_used
    assert len(calls) <= model.params.num_layers * model.params.num_experts  # one matmul per expert used
    assert sum(calls) == model.params.num_layers * 20 * model.params.num_experts_used


def test_head_dim_from_key_length_sizes_the_kv_pool(tmp_path):
    """Qwen3 / Gemma heads are not hidden / heads wide: ModelInfo (which sizes the pool) and
    the loader read key_length."""
    hf = tiny_hf_model("qwen3", head_dim=24)
    gguf = GGUFFile(write_gguf(hf, str(tmp_path / "qwen3.gguf")))
    info = ModelInfo.from_gguf(gguf)
    assert (info.architecture, info.head_dim, info.num_kv_heads) == ("qwen3", 24, 2)
    assert info.kv_bytes_per_token() == 2 * 2 * 2 * 24 * 4  # layers * (K, V) * kv heads * dim * fp32
    assert load_weights(gguf, progress=False).params.head_dim == 24


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    path = str(tmp_path / "mamba.gguf")
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError) as info:
        ModelInfo.from_gguf(GGUFFile(path))
    message = str(info.value)
    assert "\n" not in message and "'mamba'" in message
    assert "llama, qwen2, qwen2moe, qwen3, qwen3moe, gemma2, gemma3, phi3" in message
