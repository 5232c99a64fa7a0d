"""Speculative decoding in the runtime (tiny random models): tree attention equals attention over
each node's path, accepted tree KV lands where plain decoding puts it, greedy and seeded
outputs equal plain decoding for every proposer and tree shape whatever else is batched (also
under preemption, with logprobs), and sampled outputs keep plain decoding's distribution
(chi-square homogeneity, fixed seeds)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from justapi.config.spec import SpecConfig
from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from tests.support.chi_square import homogeneity
from workers.engine import LLMEngine
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import TorchCpuBackend
from workers.model.forward import DecoderModel
from workers.runner import ModelRunner
from workers.sampler import Sampler
from workers.spec.step import tree_layout
from workers.weights.gguf_loader import load_weights

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TARGET = "synthetic:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,context=512,seed=3"
DRAFT = "synthetic:layers=1,hidden=32,heads=2,kv_heads=1,ffn=64,context=512,seed=5"
NEAR = TARGET + ",type=Q4_0"  # the target's weights in 4 bits: a draft that is often right
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 101, 102, 100, 101],
           list(range(30, 70))]


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return DecoderModel(load_weights(GGUFFile(tiny_gguf(layers=2, type="F32", context=128)),
                                  progress=False))


def runner_of(model: DecoderModel) -> ModelRunner:
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, 64, BS, p.num_kv_heads, p.head_dim))
    return ModelRunner(model, pool, TorchCpuBackend(BS), Sampler(0))


def with_drafts(plan: StepPlan, num_drafts: int, parents: list[int]) -> StepPlan:
    return dataclasses.replace(plan, num_draft_tokens=np.asarray([num_drafts], np.int32),
                               draft_parents=np.asarray(parents, np.int32))


PROMPT = [11, 12, 13, 14, 15, 16, 17]
TREE_TOKENS, TREE_PARENTS = [40, 41, 42, 43, 44, 45], [-1, -1, 0, 0, 3, 1]


def paths() -> list[list[int]]:
    out: list[list[int]] = []
    for token, parent in zip(TREE_TOKENS, TREE_PARENTS):
        out.append((out[parent] if parent >= 0 else []) + [token])
    return out


def prefill(runner: ModelRunner, tokens: list[int]) -> None:
    runner.execute(StepPlan.build(1, [("a", 0, tokens, list(range(16)), False)],
                                  [NewRequest("a", GREEDY, len(tokens), np.asarray(tokens, np.int32))]))


def test_tree_attention_sees_exactly_each_nodes_path(model):
    runner = runner_of(model)
    prefill(runner, PROMPT[:-1])
    plan = with_drafts(StepPlan.build(2, [("a", 6, PROMPT[-1:] + TREE_TOKENS, list(range(16)), True)]),
                       len(TREE_TOKENS), TREE_PARENTS)
    logits = runner.forward_logits(plan, tree_layout(plan))  # [root + 6 nodes, vocab]
    for node, path in enumerate(paths()):
        dense = runner_of(model)
        tokens = PROMPT + path
        chain = StepPlan.build(1, [("a", 0, tokens, list(range(16)), True)],
                               [NewRequest("a", GREEDY, len(tokens), np.asarray(tokens, np.int32))])
        expected = dense.forward_logits(chain)[-1]
        torch.testing.assert_close(logits[1 + node], expected, atol=1e-4, rtol=1e-4)


def test_an_accepted_tree_path_leaves_plain_decodings_kv_at_its_positions(model):
    runner = runner_of(model)
    prefill(runner, PROMPT[:-1])
    # Greedy tokens after PROMPT, then put them on the tree's second branch (nodes 1 -> 5).
    dense = runner_of(model)
    prefill(dense, PROMPT[:-1])
    first = int(dense.execute(StepPlan.build(2, [("a", 6, PROMPT[-1:], list(range(16)), True)]))
                .sampled_token_ids[0])
    second = int(dense.execute(StepPlan.build(3, [("a", 7, [first], list(range(16)), True)]))
                 .sampled_token_ids[0])
    tokens = [first + 1, first, 42, 43, 44, second]
    plan = with_drafts(StepPlan.build(2, [("a", 6, PROMPT[-1:] + tokens, list(range(16)), True)]),
                       6, TREE_PARENTS)
    result = runner.execute(plan)
    assert result.sampled_token_ids.tolist()[:2] == [first, second]  # nodes 1 and 5 accepted
    dense.execute(StepPlan.build(4, [("a", 8, [second], list(range(16)), True)]))
    slots = slice(7, 9)  # positions 7 (first) and 8 (second) in block 1 (block size 4)
    kv_tree = runner.pool.tensor.view(*runner.pool.tensor.shape[:2], -1, *runner.pool.tensor.shape[4:])
    kv_dense = dense.pool.tensor.view(*dense.pool.tensor.shape[:2], -1, *dense.pool.tensor.shape[4:])
    torch.testing.assert_close(kv_tree[:, :, slots], kv_dense[:, :, slots], atol=1e-5, rtol=1e-5)
    assert runner.requests["a"].token_ids == PROMPT + [first, second]


# ------------------------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def target():
    engine = LLMEngine(TARGET, progress=False, block_size=BS, num_blocks=256, seed=7)
    yield engine
    engine.close()


def speculative(spec: SpecConfig, num_blocks: int = 256, seed: int = 7) -> LLMEngine:
    return LLMEngine(TARGET, progress=False, block_size=BS, num_blocks=num_blocks, seed=seed,
                     speculative=spec)


SHAPES = [dict(gamma=4), dict(gamma=3, branch=2), dict(spec_tree="3,2,1", spec_adaptive=False),
          dict(gamma=2, branch=3, spec_budget=5)]


@pytest.mark.parametrize("proposer", ["ngram", TARGET, DRAFT])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_greedy_output_is_plain_decodings(target, proposer, shape):
    spec = SpecConfig(spec="ngram", **shape) if proposer == "ngram" else \
        SpecConfig(draft_model=proposer, **shape)
    engine = speculative(spec)
    plain = [o.token_ids for o in target.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
    stats = engine.loop.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if proposer == TARGET:  # the target as its own draft: every draft is right
        assert stats["spec_decode_num_accepted_tokens"] > 0
        assert stats["spec_decode_draft_acceptance_rate"] > (0.99 if spec.is_chain else 0.3)
    engine.close()


def test_batch_mates_preemption_and_logprobs_do_not_change_greedy_outputs(target):
    params = [GREEDY, SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True),
              dataclasses.replace(GREEDY, logprobs=3),
              SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True)]
    plain = target.generate(PROMPTS + [PROMPTS[0]], params)
    engine = speculative(SpecConfig(draft_model=DRAFT, spec_tree="2,2", spec_adaptive=False),
                         num_blocks=24)  # 24 blocks of 4 tokens: requests preempt each other
    outs = engine.generate(PROMPTS + [PROMPTS[0]], params)
    for i in (0, 2, 3):  # greedy, greedy with logprobs, seeded: token for token
        assert outs[i].token_ids == plain[i].token_ids
    assert engine.loop.stats()["num_preemptions"] > 0
    engine.close()


def test_logit_bias_keeps_greedy_outputs_plain_and_the_draft_proposes_with_it(target):
    biased = dataclasses.replace(GREEDY, logit_bias={t: 4.0 for t in range(3, 300, 5)})
    plain = [o.token_ids for o in target.generate(PROMPTS, biased)]
    assert plain != [o.token_ids for o in target.generate(PROMPTS, GREEDY)]  # the bias matters
    engine = speculative(SpecConfig(draft_model=TARGET, gamma=4))
    assert [o.token_ids for o in engine.generate(PROMPTS, biased)] == plain
    # the target as its own draft: right every time only if the draft adds the bias too
    assert engine.loop.stats()["spec_decode_draft_acceptance_rate"] > 0.99
    engine.close()


def test_draft_kv_stays_valid_through_prefix_hits_and_preemption(target):
    """The target as its own draft accepts every draft - only if the draft's KV is right
    everywhere: in prefix-cache blocks another request computed, and after recompute."""
    shared = list(range(40, 72))  # 8 full blocks, cached by the first request
    prompts = [shared + [1, 2], shared + [3, 4, 5], shared + [6]]
    plain = [o.token_ids for o in target.generate(prompts, GREEDY)]
    spec = SpecConfig(draft_model=TARGET, gamma=3, spec_adaptive=False)
    one_at_a_time = LLMEngine(TARGET, progress=False, block_size=BS, num_blocks=64, seed=7,
                              max_seqs=1, speculative=spec)
    assert [o.token_ids for o in one_at_a_time.generate(prompts, GREEDY)] == plain
    stats = one_at_a_time.loop.stats()
    assert stats["prefix_cache_hits"] >= 16 and stats["spec_decode_draft_acceptance_rate"] == 1.0
    one_at_a_time.close()
    crowded = speculative(spec, num_blocks=20)  # too few blocks for all three: preemption
    assert [o.token_ids for o in crowded.generate(prompts, GREEDY)] == plain
    stats = crowded.loop.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_draft_acceptance_rate"] == 1.0
    crowded.close()


def test_seeded_sampling_is_plain_decodings_and_reproducible(target):
    params = [SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=s,
                             max_tokens=20, ignore_eos=True) for s in (1, 2, 3)]
    plain = [o.token_ids for o in target.generate(PROMPTS, params)]
    for spec in (SpecConfig(spec="ngram", branch=2), SpecConfig(draft_model=TARGET),
                 SpecConfig(draft_model=DRAFT, spec_tree="2,2,2", spec_adaptive=False)):
        engine = speculative(spec, seed=11)
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain
        engine.close()


def test_logprobs_of_accepted_drafts_equal_plain_decodings(model):
    params = dataclasses.replace(GREEDY, logprobs=3)
    dense = runner_of(model)
    dense.execute(StepPlan.build(1, [("a", 0, PROMPT[:-1], list(range(16)), False)],
                                 [NewRequest("a", params, 6, np.asarray(PROMPT[:-1], np.int32))]))
    tokens, results = PROMPT[-1:], []
    for step in range(4):  # plain decoding: one token and its logprobs per step
        results.append(dense.execute(StepPlan.build(2 + step, [("a", 6 + step, tokens[-1:],
                                                                 list(range(16)), True)])))
        tokens.append(int(results[-1].sampled_token_ids[0]))
    runner = runner_of(model)
    runner.execute(StepPlan.build(1, [("a", 0, PROMPT[:-1], list(range(16)), False)],
                                  [NewRequest("a", params, 6, np.asarray(PROMPT[:-1], np.int32))]))
    plan = with_drafts(StepPlan.build(2, [("a", 6, tokens[:4], list(range(16)), True)]), 3,
                       [-1, 0, 1])
    verified = runner.execute(plan)  # three right drafts + the bonus token
    assert verified.sampled_token_ids.tolist() == tokens[1:5]
    np.testing.assert_allclose(verified.logprobs, [r.logprobs[0] for r in results], atol=1e-5)
    np.testing.assert_array_equal(verified.top_logprob_ids,
                                  np.concatenate([r.top_logprob_ids for r in results]))


# ------------------------------------------------------------------------------ distribution


NUM_SAMPLES = 1200


def sample_tokens(engine: LLMEngine, num: int = NUM_SAMPLES) -> list[tuple[int, ...]]:
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    return [tuple(o.token_ids[1:3]) for o in engine.generate([PROMPTS[0]] * num, params)]


def wide(spec: SpecConfig | None = None, seed: int = 13) -> LLMEngine:
    """Room for every sample at once: one batch of NUM_SAMPLES sequences."""
    return LLMEngine(TARGET, progress=False, block_size=BS, num_blocks=6 * NUM_SAMPLES, seed=seed,
                     max_seqs=NUM_SAMPLES, max_batched_tokens=16 * NUM_SAMPLES, speculative=spec)


@pytest.fixture(scope="module")
def plain_samples():
    engine = wide()
    yield sample_tokens(engine)
    engine.close()


@pytest.mark.parametrize("spec", [
    SpecConfig(draft_model=NEAR, gamma=3, spec_adaptive=False),
    SpecConfig(draft_model=NEAR, spec_tree="3,2", spec_adaptive=False),
    SpecConfig(spec="ngram", spec_tree="2,2", spec_adaptive=False),
], ids=["draft-chain", "draft-tree", "ngram-tree"])
def test_sampled_tokens_keep_the_plain_distribution(plain_samples, spec):
    """Tokens 2 and 3 of 1200 unseeded samples (top_k 4: 16 outcomes) with speculation vs
    without: a chi-square homogeneity test must not tell them apart (p > 0.001)."""
    engine = wide(spec)
    spec_samples = sample_tokens(engine)
    stats = engine.loop.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if spec.spec == "draft":
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert homogeneity(plain_samples, spec_samples) > 1e-3
    engine.close()
