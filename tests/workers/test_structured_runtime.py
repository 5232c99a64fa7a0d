"""Structured outputs in the runtime: the worker's bitmask application, logprobs under a mask,
and the whole in-process engine on a tiny random model. Forced tokens (jump-forward), n-gram drafts
and draft models all give exactly plain constrained greedy decoding's tokens."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from justapi.config.spec import SpecConfig
from justapi.sampling import SamplingParams, StructuredOutput
from workers.engine import LLMEngine
from workers.sampler import Sampler, SamplingRow, apply_token_bitmask

TARGET = "synthetic:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,context=512,seed=3"
DRAFT = "synthetic:layers=1,hidden=32,heads=2,kv_heads=1,ffn=64,context=512,seed=5"
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 5},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["small", "large"]},
    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["title", "count", "kind", "flags"], "additionalProperties": False}
CONSTRAINTS = [StructuredOutput("json_schema", json.dumps(SCHEMA)),
               StructuredOutput("regex", "[a-f]{2}-[0-9]{2,3}"),
               StructuredOutput("choice", json.dumps(["north", "south", "northeast"])),
               StructuredOutput("gbnf", 'root ::= "v" [0-9] "." [0-9]')]
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 101, 102, 100, 101], list(range(30, 50)),
           [40, 41, 42]]


def _mask(rows: int, words: int, allowed: list[list[int]]) -> np.ndarray:
    out = np.zeros((rows, words), dtype=np.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            out[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return out


def test_bitmask_sets_disallowed_and_padding_logits_to_minus_inf() -> None:
    logits = torch.randn(3, 70)  # 70 logits, masks of 2 words (64 ids): 64..69 are padding
    before = logits.clone()
    apply_token_bitmask(logits, np.asarray([0, 2], np.int32), _mask(2, 2, [[0, 31, 63], [32]]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 63]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [32]
    assert torch.equal(logits[1], before[1])  # a free row is untouched
    assert torch.equal(logits[0, [0, 31, 63]], before[0, [0, 31, 63]])


def test_logprobs_under_a_mask_are_of_the_masked_distribution() -> None:
    logits = torch.randn(1, 40)
    apply_token_bitmask(logits, np.asarray([0], np.int32), _mask(1, 2, [[3, 7]]))
    params = SamplingParams(temperature=0.0, logprobs=4)
    out = Sampler(0).sample(logits, [SamplingRow(params, np.zeros(0, np.int64), 0, 1)])
    assert int(out.token_ids[0]) in (3, 7)
    assert out.top_ids is not None and out.top_logprobs is not None and out.logprobs is not None
    assert sorted(out.top_ids[0, :2].tolist()) == [3, 7] and out.top_ids[0, 2:].tolist() == [-1, -1]
    assert np.isclose(np.exp(out.top_logprobs[0, :2]).sum(), 1.0, atol=1e-5)


# ------------------------------------------------------------------------------ engines
GREEDY = SamplingParams(temperature=0.0, max_tokens=80)


def _engine(spec: SpecConfig | None = None, max_forced_tokens: int | None = None,
            num_blocks: int = 256) -> LLMEngine:
    engine = LLMEngine(TARGET, progress=False, block_size=4, num_blocks=num_blocks, seed=7,
                       speculative=spec)
    if max_forced_tokens is not None:
        engine.structured_outputs().max_forced_tokens = max_forced_tokens
    return engine


def _params(base: SamplingParams = GREEDY) -> list[SamplingParams]:
    """One request per constraint, then a free one (shorter: it only shares the steps)."""
    return [SamplingParams(**{**base.to_dict(), "structured": c}) for c in CONSTRAINTS] + [
        SamplingParams(**{**base.to_dict(), "max_tokens": 24})]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    """Plain constrained greedy decoding: one token a step, no drafts, no forced tokens."""
    engine = _engine(max_forced_tokens=0)
    outs = engine.generate(PROMPTS + [PROMPTS[0]], _params())
    assert engine.loop is not None and engine.loop.stats()["num_draft_tokens"] == 0
    engine.close()
    return [o.token_ids for o in outs]


def test_constrained_outputs_are_valid(plain) -> None:
    engine = _engine()
    outs = engine.generate(PROMPTS + [PROMPTS[0]], _params())
    assert [o.finish_reason for o in outs[:4]] == ["stop"] * 4
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert outs[2].text in ("north", "south", "northeast")
    assert [o.token_ids for o in outs] == plain  # forced tokens jumped over: same tokens
    stats = engine.loop.stats() if engine.loop else {}
    assert stats["structured_forced_tokens"] > 0
    assert stats["num_steps"] < max(len(t) for t in plain[:4])
    engine.close()


@pytest.mark.parametrize("spec", [SpecConfig(spec="ngram", gamma=4),
                                  SpecConfig(spec="ngram", gamma=3, branch=2),
                                  SpecConfig(draft_model=DRAFT, spec_tree="2,2",
                                             spec_adaptive=False)],
                         ids=["ngram", "ngram-tree", "draft-tree"])
def test_speculative_decoding_with_a_constraint_is_plain_greedy(plain, spec) -> None:
    engine = _engine(spec)
    assert [o.token_ids for o in engine.generate(PROMPTS + [PROMPTS[0]], _params())] == plain
    engine.close()


def test_preemption_and_sampling_with_constraints() -> None:
    engine = _engine(num_blocks=32)  # 32 blocks of 4 tokens: requests preempt each other
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=96, seed=11)
    outs = engine.generate(PROMPTS + [PROMPTS[0], PROMPTS[1]], _params(sampled)[:4] + [sampled] * 2)
    assert engine.loop is not None and engine.loop.stats()["num_preemptions"] > 0
    assert outs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert outs[2].text in ("north", "south", "northeast")
    engine.close()
