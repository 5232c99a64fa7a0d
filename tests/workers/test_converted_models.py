"""Files made by llama.cpp's own converter (tests/support/llama_convert.py), not our writer: for
every architecture we serve, plus Phi-3 with LongRoPE, Qwen2/Qwen3 with YaRN, Llama-3 rope
scaling and Mistral with a sliding window, tiny random HF models are converted (f32, and q8_0 /
f16 for some) and our logits and greedy tokens compared with transformers'.
- exact flags (`--weights fp32 --kv-cache-dtype float32`): prefill and chunked-prefill logits
  equal transformers' and so do 16 greedy tokens (LongRoPE: a prompt within the original context
  and one past it; one that decodes past it equals transformers' generate(), which recomputes
  its cache with the long table there, as our scheduler does);
- the defaults in force (`justapi generate` with no flags): logits along transformers' greedy
  path stay within a few percent of its scale and every greedy choice whose top-two margin
  exceeds the error is its own (these random models have margins of 1e-3: 16-bit rounding flips
  some, as it does llama.cpp's).
Mistral: llama.cpp's converter writes no sliding window and llama.cpp applies none, so the file
attends to every key (docs/models.md). All conversions run in one converter process."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from tests.support.hf_gguf import hf_logits, tiny_hf_model
from tests.support.llama_convert import convert_all, require_converter, round_for, save_hf_model
from tests.workers.test_architectures import CASES as ARCH_CASES
from tests.workers.test_architectures import WINDOW, all_row_logits, assert_matches, make_runner, Seqs
from workers.engine import LLMEngine

pytest.importorskip("transformers")

VOCAB = 600  # the SentencePiece / BPE vocabularies trained offline, padded by the converter
ORIGINAL = 32  # original context of the scaled ropes; their files say 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SHORT_FACTORS = [1.0 + 0.15 * i for i in range(8)]
LONG_FACTORS = [1.5 + 0.6 * i for i in range(8)]
LONGROPE = dict(max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT_FACTORS,
    "long_factor": LONG_FACTORS, "original_max_position_embeddings": ORIGINAL})
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    fields: dict
    outtype: str = "f32"
    tokenizer: str = "spm"
    prompts: tuple[int, ...] = (12,)
    """Prompt lengths of the greedy runs (LongRoPE: within and past the original context)."""


def _arch(name: str, **kwargs) -> Case:
    fields = dict(ARCH_CASES[name])
    return Case(fields.pop("model_type"), fields, **kwargs)


CASES = {
    "llama": _arch("llama", outtype="q8_0"),
    "llama3-rope": _arch("llama3-rope"),
    "mistral": _arch("mistral"),
    "mixtral": _arch("mixtral"),
    "qwen2": _arch("qwen2"),
    "qwen2moe": _arch("qwen2moe", tokenizer="bpe"),
    "qwen3": _arch("qwen3", outtype="f16"),
    "qwen3moe": _arch("qwen3moe", tokenizer="bpe"),
    "gemma2": _arch("gemma2"),
    "gemma3": _arch("gemma3"),
    "phi3": _arch("phi3"),
    "phi3-longrope": Case("phi3", dict(sliding_window=None, **LONGROPE), "q8_0", prompts=(10, 40)),
    "qwen3-yarn": Case("qwen3", dict(head_dim=24, max_position_embeddings=4 * ORIGINAL,
                                     rope_parameters=YARN), prompts=(40,)),
    "qwen2-yarn": Case("qwen2", dict(max_position_embeddings=4 * ORIGINAL, rope_parameters={
        **YARN, "attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0}), "q8_0", prompts=(40,)),
}


@dataclasses.dataclass
class Converted:
    case: Case
    hf: object
    path: Path
    references: dict[int, tuple[list[int], torch.Tensor]] = dataclasses.field(default_factory=dict)

    def reference_tokens(self, prompt: list[int], num: int) -> list[int]:
        ids = list(prompt)
        for _ in range(num):
            ids.append(int(hf_logits(self.hf, ids)[-1].argmax()))
        return ids[len(prompt):]

    def reference(self, length: int) -> tuple[list[int], list[int], torch.Tensor]:
        """(prompt, transformers' greedy tokens, its logits at each of those steps [n, vocab]):
        each step a full forward, as hf_gguf.hf_greedy (no cache to trust); computed once."""
        prompt = prompt_of(length)
        if length not in self.references:
            ids = list(prompt)
            for _ in range(GREEDY.max_tokens):
                logits = hf_logits(self.hf, ids)
                ids.append(int(logits[-1].argmax()))
            self.references[length] = (ids[length:], logits[length - 1:])
        return (prompt, *self.references[length])


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Converted]:
    """Every case's HF model (weights rounded as its file stores them) and converted file."""
    require_converter()
    root = tmp_path_factory.mktemp("converted")
    out, jobs = {}, []
    for seed, (name, case) in enumerate(CASES.items()):
        hf = tiny_hf_model(case.model_type, seed=seed, vocab_size=VOCAB, **case.fields)
        round_for(hf, case.outtype)
        directory = save_hf_model(hf, root / name, case.tokenizer)
        out[name] = Converted(case, hf, root / f"{name}.gguf")
        jobs.append((directory, out[name].path, case.outtype))
    convert_all(jobs)
    # llama.cpp reads no window from Mistral files (its converter writes none): nor do we
    out["mistral"].hf.config.sliding_window = None
    return out


@pytest.fixture(params=list(CASES))
def model(request, converted) -> Converted:
    return converted[request.param]


def prompt_of(length: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, length).tolist()


def test_exact_flags_give_transformers_logits_and_greedy_tokens(model):
    """`--weights fp32 --kv-cache-dtype float32`: a prompt's logits whole and in chunks (short,
    long, single; SDPA backend), and the engine's greedy tokens (scheduler, chunked prefill of
    16, the CPU attention kernel) are transformers'."""
    engine = LLMEngine(str(model.path), weights="fp32", kv_cache_dtype="float32", chunk_size=16,
                       progress=False)
    length = 45 if model.case.prompts[-1] > ORIGINAL else 37  # past the original context
    seqs = Seqs({"a": length}, VOCAB, seed=1)
    expected = hf_logits(model.hf, seqs.tokens["a"])
    runner, start = make_runner(engine.model), 0
    for step, size in enumerate([7, 18, 1, length - 26]):
        (logits,) = all_row_logits(runner, step, [seqs.chunk("a", start, size)], [seqs.new("a")] if step == 0 else [])
        assert_matches(logits, expected[start:start + size])
        start += size
    for length in model.case.prompts:
        prompt, tokens, _ = model.reference(length)
        (out,) = engine.generate([prompt], GREEDY)
        assert out.token_ids == tokens, f"prompt of {length}"


def test_default_flags_follow_transformers_within_their_rounding(model):
    """The defaults in force (`--weights auto`, the auto KV cache dtype), prompt then decode
    steps along transformers' greedy path: every row's logits within 25% of their scale and the
    median row within 3% (a wrong rope or scale is off everywhere; a MoE row whose router flips
    between two experts may be off alone); our greedy choice is transformers' at every step
    whose top-two margin exceeds twice that row's error."""
    engine = LLMEngine(str(model.path), weights="auto", kv_cache_dtype="auto", progress=False)
    prompt, reference, expected = model.reference(model.case.prompts[-1])  # expected: [steps, vocab]
    seqs = Seqs({"a": len(prompt + reference)}, VOCAB)
    seqs.tokens["a"] = prompt + reference
    chunks = [seqs.chunk("a", 0, len(prompt))] + [seqs.chunk("a", len(prompt) + i, 1)
                                                  for i in range(len(reference) - 1)]  # [steps]
    ours = torch.cat([all_row_logits(engine.runner, step, [chunk], [seqs.new("a")] if step == 0 else [])[0][-1:]
                      for step, chunk in enumerate(chunks)])  # [steps, vocab]
    errors = (ours - expected).abs().amax(dim=-1)
    scale = float(expected.abs().max())
    assert float(errors.max()) <= 0.25 * scale and float(errors.median()) <= 0.03 * scale, errors
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * errors
    assert torch.equal(ours.argmax(-1)[clear], expected.argmax(-1)[clear])


def hf_generate(hf, prompt: list[int], num: int) -> list[int]:
    """transformers' own greedy generate() (Phi-3: its cache recomputed with the long table
    where the sequence outgrows the original context), EOS ignored as GREEDY ignores it."""
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), generation_config=config, max_new_tokens=num,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


def forward_over_cache(hf, prompt: list[int], num: int) -> list[int]:
    """Greedy tokens of transformers' forward over its KV cache, never recomputed: the keys
    cached before the crossing keep the short table."""
    out, ids, cache = [], torch.tensor([prompt]), None
    with torch.inference_mode():
        for _ in range(num):
            step = hf(ids, past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.tensor([out[-1:]])
    return out


def test_longrope_greedy_decoding_across_the_original_context_is_transformers_generate(converted):
    """A prompt within the original context that decodes past it: the scheduler recomputes the
    sequence with the long table where generate() drops its cache, so every greedy token is
    generate()'s (not those of the keys cached before the crossing). In the same batch, a
    longer prompt with the same first block takes no cached block of the short one (another
    table: the cache salt) and is generate()'s too."""
    model = converted["phi3-longrope"]
    prompt = prompt_of(ORIGINAL - 6, seed=5)  # crosses at its 7th token
    longer = prompt + prompt_of(12, seed=6)
    expected = [hf_generate(model.hf, prompt, 14), hf_generate(model.hf, longer, 4)]
    engine = LLMEngine(str(model.path), weights="fp32", kv_cache_dtype="float32", progress=False)
    outs = engine.generate([prompt, longer], [dataclasses.replace(GREEDY, max_tokens=14),
                                              dataclasses.replace(GREEDY, max_tokens=4)])
    assert [out.token_ids for out in outs] == expected
    assert engine.loop is not None and engine.loop.stats()["num_long_rope_recomputes"] == 1
    assert expected[0] != forward_over_cache(model.hf, prompt, 14)  # the recompute matters


def test_scaled_ropes_are_read_from_the_converted_files(converted):
    """What the converter wrote is what transformers computes with: LongRoPE's tables and
    attention factor, YaRN's factor, original context, attention factor and betas. The
    control plane reads LongRoPE's original context from the same file (ModelInfo), and the
    scheduler built for it (factory) switches tables there."""
    from justapi.config.serve import ServeConfig
    from justapi.model.info import ModelInfo
    from justapi.scheduler.factory import build_scheduler
    from tests.scheduler.test_scheduler_factory import ready
    from workers.model.rotary import Rotary, yarn_inv_freq
    from workers.weights.gguf_loader import load_weights

    path = str(converted["phi3-longrope"].path)
    longrope = load_weights(GGUFFile(path), progress=False)
    p = longrope.params
    assert (p.rope_scaling.kind, p.rope_scaling.original_context) == ("longrope", ORIGINAL)
    assert ModelInfo.from_gguf(GGUFFile(path)).long_rope_context == ORIGINAL
    assert ModelInfo.from_gguf(GGUFFile(str(converted["qwen3-yarn"].path))).long_rope_context == 0
    core = build_scheduler(ServeConfig(), [ready(0, 0)], {"eos_token_ids": [], "model_path": path})
    assert core.state.limits.long_rope_context == ORIGINAL
    hf_rotary = converted["phi3-longrope"].hf.model.rotary_emb
    assert p.rope_scaling.attn_factor == pytest.approx(hf_rotary.attention_scaling, rel=1e-6)
    short, long = longrope.long_rope_factors
    assert torch.allclose(short, torch.tensor(SHORT_FACTORS)) and torch.allclose(long, torch.tensor(LONG_FACTORS))
    rotary = Rotary(p.rotary_dims, p.rope_theta, scaling=p.rope_scaling, long_factors=longrope.long_rope_factors)
    cos, _ = rotary.tables(torch.tensor([3, 3]), torch.float32, torch.tensor([False, True]))
    assert not torch.allclose(cos[0], cos[1])  # the long table where told
    for name, attn in (("qwen3-yarn", 0.1 * np.log(4.0) + 1), ("qwen2-yarn", 1.25)):
        p = load_weights(GGUFFile(str(converted[name].path)), progress=False).params
        assert (p.rope_scaling.kind, p.rope_scaling.factor, p.rope_scaling.original_context) == ("yarn", 4.0, ORIGINAL)
        assert p.rope_scaling.attn_factor == pytest.approx(attn, rel=1e-6)
        hf_inv = converted[name].hf.model.rotary_emb.inv_freq.float()
        assert torch.allclose(yarn_inv_freq(p.rotary_dims, p.rope_theta, p.rope_scaling), hf_inv, rtol=1e-6)


@pytest.mark.parametrize("name", ["phi3-longrope", "qwen2-yarn"])
def test_the_c_layer_chain_rotates_with_the_scaled_tables(converted, name):
    """q8_0 files under `--weights auto` (every matrix the file's blocks): decode steps run as
    one C call (cpu_layer_chain.py) and, decoding past the original context, give the layer
    loop's logits over the same blocks (the loop rotates with torch's tables)."""
    from workers.weights.block_kernels import block_kernels
    from workers.weights.path_plan import PathPlan
    from workers.weights.paths import load_model

    if block_kernels() is None:
        pytest.skip("no C compiler: no block kernels")
    gguf = GGUFFile(str(converted[name].path))
    chained = load_model(gguf, weights="auto", progress=False, plan=PathPlan.only("int8"))
    assert chained.layer_chain is not None
    runs = []
    chain_run = chained.layer_chain.run
    chained.layer_chain.run = lambda *args: runs.append(1) or chain_run(*args)  # type: ignore[method-assign]
    seqs = Seqs({"a": ORIGINAL + 6}, VOCAB, seed=7)
    chunks = [seqs.chunk("a", 0, ORIGINAL - 4)] + [seqs.chunk("a", p, 1) for p in range(ORIGINAL - 4, ORIGINAL + 6)]
    logits = {}
    looped = load_model(gguf, weights="auto", progress=False, plan=PathPlan.only("int8"))
    looped.layer_chain = None
    for model in (chained, looped):
        runner = make_runner(model, kernel=True)
        logits[model] = torch.cat([all_row_logits(runner, i, [c], [seqs.new("a")] if i == 0 else [])[0][-1:]
                                   for i, c in enumerate(chunks)])
    assert len(runs) == len(chunks) - 1  # every decode step
    first, second = logits.values()
    torch.testing.assert_close(first, second, atol=1e-4 * float(second.abs().max()), rtol=0)


@pytest.mark.parametrize("name", ["phi3-longrope", "qwen3-yarn"])
def test_the_triton_kernels_rotate_with_the_scaled_tables(converted, name, monkeypatch):
    """The GPU forward's small-op kernels (Triton's CPU interpreter) on a prefill past the
    original context: the same logits as the torch forms, rotary included."""
    pytest.importorskip("triton")
    from workers.model import ffn, forward
    from workers.model.triton_attention import is_interpreted
    from workers.model.triton_layer_ops import TritonLayerOps

    if not is_interpreted():
        pytest.skip("runs the kernels in Triton's interpreter (TRITON_INTERPRET=1)")
    engine = LLMEngine(str(converted[name].path), weights="fp32", kv_cache_dtype="float32", progress=False)
    seqs = Seqs({"a": ORIGINAL + 8}, VOCAB, seed=8)
    chunk = [seqs.chunk("a", 0, ORIGINAL + 8)]
    results, rotations = [], []
    for ops in (None, TritonLayerOps()):
        if ops is not None:
            rotary = ops.rotary
            ops.rotary = lambda *args: rotations.append(1) or rotary(*args)  # type: ignore[method-assign]
        monkeypatch.setattr(forward, "ops_for", lambda device, ops=ops: ops)
        monkeypatch.setattr(ffn, "ops_for", lambda device, ops=ops: ops)
        results.append(all_row_logits(make_runner(engine.model), 0, chunk, [seqs.new("a")])[0])
    assert len(rotations) == engine.model.params.num_layers
    torch.testing.assert_close(results[1], results[0], atol=1e-4 * float(results[0].abs().max()), rtol=0)
    assert_matches(results[0], hf_logits(converted[name].hf, seqs.tokens["a"]))


def test_mistral_files_carry_no_window(converted):
    assert GGUFFile(str(converted["mistral"].path)).arch_get("attention.sliding_window") is None
    assert converted["mistral"].case.fields["sliding_window"] == WINDOW  # the HF model had one
