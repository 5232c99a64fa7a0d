"""SmolLM2-135M (Q4_1 layers, Q8_0 tied head) on the int4 path (--weights q4): perplexity on
the repo's fixed text within 1% of fp32, computed in whole windows and in 16-token chunks
(decode-sized steps), and greedy decoding on the int4 path departs from fp32's only where fp32
itself nearly ties (the chosen token within a small margin of fp32's best). auto's int8 block
kernels (int8 and int8 panels, each forced for every matrix, 16-row steps) stay within 1% of fp32.
The agreement figures are printed (pytest -s) and recorded as test properties."""
from __future__ import annotations

import pytest
import torch

from justapi.ops.perplexity import DEFAULT_TEXT
from justapi.sampling import SamplingParams
from workers.engine import LLMEngine
from workers.weights import paths as weight_paths
from workers.weights.block_kernels import block_kernels
from workers.weights.path_plan import PathPlan
from workers.model.perplexity import perplexity, position_logits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TEXT = DEFAULT_TEXT  # the text `justapi perplexity` scores by default
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are"]
NUM_TOKENS = 24
NEAR_TIE_NATS = 0.25
"""A departure is allowed only where fp32 rates the int4 path's token at most this far below
its own best: the int4 path's logits are off by a few hundredths (bf16 rounding, see
test_quant_linear), so a wider margin than that would hide a real error."""


@pytest.fixture(scope="module")
def engines(smollm2_path):
    made = {mode: LLMEngine(smollm2_path, weights=mode, progress=False, num_blocks=48, max_seqs=4)
            for mode in ("fp32", "q4")}
    yield made
    for engine in made.values():
        engine.close()


@pytest.fixture(scope="module")
def fp32_perplexity(engines):
    ids = engines["fp32"].encode(TEXT.read_text())
    return ids, perplexity(engines["fp32"], ids, n_ctx=512)


def test_int4_perplexity_within_one_percent_of_fp32(engines, fp32_perplexity, record_property):
    ids, fp32 = fp32_perplexity
    q4 = perplexity(engines["q4"], ids, n_ctx=512)
    q4_small = perplexity(engines["q4"], ids, n_ctx=512, chunk_rows=16)
    assert fp32.num_scored == q4.num_scored == q4_small.num_scored == 768
    for name, result in (("q4", q4), ("q4_chunks_16", q4_small)):
        change = result.perplexity / fp32.perplexity - 1
        record_property(f"perplexity_{name}", result.perplexity)
        print(f"perplexity fp32 {fp32.perplexity:.3f}, {name} {result.perplexity:.3f} ({100 * change:+.2f}%)")
        assert abs(change) < 0.01
        assert result.perplexity != fp32.perplexity  # computed on another kernel


@pytest.mark.parametrize("path", ["int8", "int8_panels"])  # measured +0.29% .. +0.75%; fp32 activations (dense) +0.00%
def test_auto_block_kernels_keep_perplexity_within_one_percent(engines, fp32_perplexity, smollm2_path,
                                                                   monkeypatch, record_property, path):
    if path == "int8_panels" and not block_kernels().has_panels:
        pytest.skip("the int8 panels need AVX2")
    monkeypatch.setattr(weight_paths, "_default_cache", lambda: None)
    monkeypatch.setattr(weight_paths.PathPlanner, "plan_for", lambda self, matrix: PathPlan.only(path))
    auto = LLMEngine(smollm2_path, weights="auto", progress=False, num_blocks=48, max_seqs=4)
    try:
        ids, fp32 = fp32_perplexity
        result = perplexity(auto, ids, n_ctx=512, chunk_rows=16)
    finally:
        auto.close()
    change = result.perplexity / fp32.perplexity - 1
    record_property(f"perplexity_auto_{path}", result.perplexity)
    print(f"perplexity fp32 {fp32.perplexity:.3f}, auto {path} {result.perplexity:.3f} ({100 * change:+.2f}%)")
    assert result.num_scored == fp32.num_scored == 768
    # Not 0.5%: rounding activations to 8 bits per 32 values makes the result sensitive to the
    # last bits upstream (a value near a rounding boundary moves by a whole step). Two builds of
    # the int8 kernel whose matmuls agree within 3e-5 on every call of this run gave +0.49% and
    # +0.70%, and the fused layer ops (1e-7 apart from torch's) +0.75%. Since the per-row kernel
    # sums each group exactly as the panels do, both give the same bits: +0.29% here.
    assert abs(change) < 0.01
    assert result.perplexity != fp32.perplexity  # computed on another kernel


def test_greedy_departs_from_fp32_only_at_near_ties(engines, record_property):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    fp32 = engines["fp32"].generate(PROMPTS, params)
    q4 = engines["q4"].generate(PROMPTS, params)
    prefixes = []
    for ref, out in zip(fp32, q4):
        prefixes.append(next((i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b),
                             NUM_TOKENS))
        sequence = out.prompt_token_ids + out.token_ids
        first = len(out.prompt_token_ids) - 1
        logits = position_logits(engines["fp32"], sequence, first, len(sequence) - 1, len(sequence))
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        gaps = logits.max(dim=1).values - chosen  # fp32's regret for each int4 greedy token
        assert float(gaps.max()) <= NEAR_TIE_NATS, (out.token_ids, gaps.tolist())
    agreement = sum(prefixes) / (len(PROMPTS) * NUM_TOKENS)
    record_property("greedy_agreement", agreement)
    print(f"greedy agreement q4 vs fp32: {100 * agreement:.1f}% of tokens before the first "
          f"difference; per prompt {prefixes} of {NUM_TOKENS}")
