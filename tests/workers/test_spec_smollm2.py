"""Speculative decoding on the real SmolLM2 (one load, shared by every variant): greedy outputs
equal plain decoding for n-gram chains and trees on input-grounded and free text, SmolLM2 as
its own draft (chain and tree: every draft accepted) and a random draft with SmolLM2's
vocabulary (almost nothing accepted; the adaptive rule then stops proposing); a JSON schema
constraint with n-gram drafts and forced tokens."""
from __future__ import annotations

import json

import pytest

from justapi.config.spec import SpecConfig
from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams, StructuredOutput
from justapi.scheduler.structured import MAX_FORCED_TOKENS
from workers.engine import LLMEngine
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import make_backend
from workers.model.forward import LlamaModel
from workers.spec.draft import DraftModel
from workers.spec.draft_gguf import write_random_draft
from workers.weights.paths import load_model

pytestmark = pytest.mark.slow

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
           "wick, polished the great lens, and watched the ships pass safely beyond the rocks.")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    engine = LLMEngine(smollm2_path, progress=False, num_blocks=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(engine):
    copy = engine.chat_prompt([{"role": "user", "content": "Repeat this passage word for word:\n\n"
                                                           + PASSAGE}])
    story = engine.chat_prompt([{"role": "user", "content": "Write two sentences about a robot "
                                                            "who learns to paint."}])
    return [copy, story]


@pytest.fixture(scope="module")
def plain(engine, prompts):
    engine.speculative, engine.runner.draft = SpecConfig(), None
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, smollm2_path):
    path = str(tmp_path_factory.mktemp("draft") / "random.gguf")
    write_random_draft(smollm2_path, path)
    return load_model(GGUFFile(path), progress=False)


def speculate(engine: LLMEngine, spec: SpecConfig, draft: LlamaModel | None = None) -> None:
    """Turn speculation on in the shared engine; a draft model gets its own KV pool."""
    engine.speculative = spec
    engine.runner.draft = None
    if draft is not None:
        p, shape = draft.params, engine.pool.shape
        pool = KVPool.create(PoolShape(p.num_layers, shape.num_blocks, shape.block_size,
                                       p.num_kv_heads, p.head_dim))
        engine.runner.draft = DraftModel(draft, pool, make_backend("cpu", shape.block_size), spec)


@pytest.mark.parametrize("spec", [
    SpecConfig(spec="ngram"),
    SpecConfig(spec="ngram", gamma=4, branch=2),
    SpecConfig(spec="ngram", spec_tree="3,2,1,1", spec_adaptive=False),
], ids=["chain", "tree-2x4", "tree-3211"])
def test_ngram_greedy_is_plain_decoding(engine, prompts, plain, spec):
    speculate(engine, spec)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    stats = engine.loop.stats()
    assert stats["spec_decode_mean_acceptance_length"] > 2.0  # the passage is copied
    assert stats["spec_decode_num_accepted_tokens"] > len(plain[0]) / 2


@pytest.mark.parametrize("spec", [SpecConfig(draft_model="self", gamma=3),
                                  SpecConfig(draft_model="self", gamma=3, branch=2, spec_budget=6)],
                         ids=["chain", "tree"])
def test_smollm2_as_its_own_draft(engine, prompts, plain, spec):
    speculate(engine, spec, engine.model)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain
    stats = engine.loop.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_mean_acceptance_length"] > 3.0  # depth 3 + the bonus token: ~4


def test_a_random_draft_is_harmless_and_the_adaptive_rule_drops_it(engine, prompts, plain,
                                                                     random_draft):
    speculate(engine, SpecConfig(draft_model="random", spec_adaptive=False), random_draft)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain
    fixed = engine.loop.stats()
    assert fixed["spec_decode_draft_acceptance_rate"] < 0.1
    speculate(engine, SpecConfig(draft_model="random"), random_draft)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain
    adaptive = engine.loop.stats()
    assert adaptive["spec_decode_num_draft_tokens"] < 0.3 * fixed["spec_decode_num_draft_tokens"]


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}


def test_a_json_schema_constraint_with_ngram_drafts_and_forced_tokens_is_plain(engine):
    """Structured outputs on SmolLM2: plain constrained greedy (one token a step, no forced
    tokens) == forced tokens jumped over + n-gram drafts cut to the grammar; the JSON validates."""
    jsonschema = pytest.importorskip("jsonschema")
    prompt = engine.chat_prompt([{"role": "user", "content": "Describe a person as JSON: name, "
                                                             "age and hobbies."}])
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured=StructuredOutput("json_schema", json.dumps(PERSON)))
    structured = engine.structured_outputs()
    speculate(engine, SpecConfig())
    structured.max_forced_tokens = 0
    [plain] = engine.generate([prompt], params)
    structured.max_forced_tokens = MAX_FORCED_TOKENS
    speculate(engine, SpecConfig(spec="ngram", gamma=4))
    [fast] = engine.generate([prompt], params)
    assert fast.token_ids == plain.token_ids and fast.finish_reason == "stop"
    jsonschema.validate(json.loads(fast.text), PERSON)
    assert engine.loop is not None and engine.loop.stats()["structured_forced_tokens"] > 5
