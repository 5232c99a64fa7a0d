"""LongRoPE in the scheduler core (justapi/scheduler/long_rope.py), with plan-checking fake
workers whose KV entries carry the rope table the real worker would pick: a sequence crossing
the original context is recomputed once with the long table, blocks of one table are never
hits for the other, and outputs equal the reference model's as transformers' generate()
computes them - with overlap, speculative decoding, multi-step plans, PD, preemption and
prefix sharing - with the invariants checked after every event and no block leaked."""
from __future__ import annotations

import random

import numpy as np
import pytest

from justapi.scheduler.long_rope import LONG_TABLE_SALT
from justapi.scheduler.sim.fake_model import ReferenceModel, mix_row, next_token
from justapi.scheduler.sim.harness import Harness, build_pd_scheduler, build_scheduler
from justapi.wire.protocol import StepPlan
from tests.scheduler.test_spec_scheduler import oracle_tree

V = 64
ORIGINAL = 12  # the model's original context
REF = ReferenceModel(V, long_rope_context=ORIGINAL)
PROMPT = [2 + (i * 7) % 60 for i in range(9)]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    return REF.generate(prompt, max_tokens, frozenset(), 10_000)[0]


def kept_short_keys(prompt: list[int], max_tokens: int) -> list[int]:
    """What a schedule without the recompute computes: the keys cached before the crossing
    keep the short table, rows past it take the long one."""
    tokens, hashes = list(prompt), REF.chain(prompt)
    for _ in range(max_tokens):
        token = next_token(np.asarray(tokens), np.asarray(hashes, dtype=np.uint64), V)
        tokens.append(token)
        hashes.append(mix_row(hashes[-1], token, len(tokens) - 1, len(tokens) > ORIGINAL))
    return tokens[len(prompt):]


def harness(**options: object) -> Harness:
    return Harness(build_scheduler(long_rope_context=ORIGINAL, **options))


def finish(h: Harness) -> dict[str, float]:
    """Run to the end: nothing held, every block back once the cache is flushed."""
    h.run()
    stats = h.scheduler.stats()
    assert stats["kv_blocks_in_use"] == 0
    h.scheduler.flush_prefix_cache()
    assert h.scheduler.stats()["kv_blocks_free"] == stats["kv_blocks_total"]
    return stats


def plans_of(out: list) -> list[StepPlan]:
    return [p for _, p in out if isinstance(p, StepPlan)]


def test_a_sequence_crossing_the_original_context_is_recomputed_once_with_the_long_table():
    h = harness()
    h.submit("a", PROMPT, max_tokens=10, ignore_eos=True)
    announced = []  # the known tokens of each NewRequest of "a"
    while h.scheduler.has_work():
        for plan in plans_of(h.step()):
            announced += [len(new.token_ids) for new in plan.new_requests]
            for rid, start, num in zip(plan.request_ids, plan.start_positions, plan.num_tokens):
                if len(announced) == 1:  # the short table: no position past the context
                    assert start + num <= ORIGINAL
    assert announced == [len(PROMPT), ORIGINAL + 1]  # recomputed with the whole sequence
    assert h.outputs["a"] == reference(PROMPT, 10) != kept_short_keys(PROMPT, 10)
    stats = finish(h)
    assert stats["num_long_rope_recomputes"] == 1 and stats["num_preemptions"] == 0


def test_prompts_past_the_context_take_the_long_table_at_once():
    h = harness()
    h.submit("a", PROMPT * 2, max_tokens=6, ignore_eos=True)  # 18 > 12 tokens
    h.step()
    req = h.scheduler.request("a")
    assert req.uses_long_rope and req.cache_salt == LONG_TABLE_SALT
    finish(h)
    assert h.outputs["a"] == reference(PROMPT * 2, 6)
    assert h.scheduler.stats()["num_long_rope_recomputes"] == 0


def test_blocks_of_one_table_are_never_hits_for_the_other():
    """A short prompt's blocks, then a long prompt with the same prefix: no hit (another
    table); a second long one hits the first's; the short prompt again hits its own."""
    short = PROMPT[:8]
    long = short + PROMPT[:8]  # 16 > 12
    h = harness(block_size=4)
    h.submit("s1", short, max_tokens=3, ignore_eos=True, cache_salt="tenant")  # ends at 11
    h.run()
    h.submit("l1", long, max_tokens=3, ignore_eos=True, cache_salt="tenant")
    h.run()
    h.submit("l2", long, max_tokens=3, ignore_eos=True, cache_salt="tenant")
    h.submit("s2", short, max_tokens=3, ignore_eos=True, cache_salt="tenant")
    finish(h)
    assert h.cached_tokens == {"s1": 0, "l1": 0, "l2": 12, "s2": 4}
    for rid, prompt in (("s1", short), ("l1", long), ("l2", long), ("s2", short)):
        assert h.outputs[rid] == reference(prompt, 3), rid


def test_a_recomputed_sequence_leaves_its_short_blocks_cached_for_others():
    h = harness(block_size=4)
    h.submit("a", PROMPT, max_tokens=6, ignore_eos=True)  # crosses at 13
    h.run()
    h.submit("b", PROMPT, max_tokens=2, ignore_eos=True)  # stays short: hits a's short blocks
    h.submit("c", PROMPT + reference(PROMPT, 6), max_tokens=2, ignore_eos=True)  # a's long ones
    finish(h)
    assert h.cached_tokens["b"] == 8 and h.cached_tokens["c"] == 12
    assert h.outputs["b"] == reference(PROMPT, 2)
    assert h.outputs["c"] == reference(PROMPT + reference(PROMPT, 6), 2)


@pytest.mark.parametrize("prompt_len", [ORIGINAL - 1, ORIGINAL, ORIGINAL + 1])
def test_overlap_plans_no_step_past_the_crossing(prompt_len):
    """With overlap the step after the one reaching the context is not planned ahead; the
    recompute follows when it lands (a prompt of exactly the context: its first token)."""
    prompt = (PROMPT * 2)[:prompt_len]
    h = harness(overlap=True)
    h.submit("a", prompt, max_tokens=8, ignore_eos=True)
    h.submit("b", PROMPT[:4], max_tokens=14, ignore_eos=True)  # keeps the worker planning ahead
    pending = plans_of(h.schedule())
    while pending or h.scheduler.has_work():
        if pending:
            h.complete(0, pending.pop(0))
        pending += plans_of(h.schedule())
    stats = finish(h)
    assert h.outputs["a"] == reference(prompt, 8) and h.outputs["b"] == reference(PROMPT[:4], 14)
    assert stats["num_long_rope_recomputes"] == (prompt_len <= ORIGINAL) + 1  # b crosses too


@pytest.mark.parametrize("spec", [dict(spec="ngram", gamma=4, spec_adaptive=False),
                                  dict(draft_model="d.gguf", gamma=4, spec_adaptive=False)])
def test_drafts_stop_at_the_original_context(spec):
    """Right drafts (an oracle draft model, or n-grams of a repeating prompt) would be verified
    past the context with the short keys: they are cut there, and every one is still right."""
    prompt = PROMPT[:4] * 2
    proposer = oracle_tree(random.Random(0), 1.0, (1, 1, 1, 1)) if "draft_model" in spec else None
    h = Harness(build_scheduler(long_rope_context=ORIGINAL, **spec), proposer=proposer)
    h.submit("a", prompt, max_tokens=14, ignore_eos=True)
    stats = finish(h)
    assert h.outputs["a"] == reference(prompt, 14)
    assert stats["num_long_rope_recomputes"] == 1


def test_multi_step_plans_stop_at_the_original_context():
    h = harness(decode_steps=4)
    h.submit("a", PROMPT[:5], max_tokens=14, ignore_eos=True)
    steps = []
    while h.scheduler.has_work():
        steps += [p.num_steps for p in plans_of(h.step()) if p.num_seqs]
    assert h.outputs["a"] == reference(PROMPT[:5], 14)
    assert steps[:4] == [1, 4, 3, 1]  # the prompt; 5..8 and 9..11 short; the recompute
    assert h.scheduler.stats()["num_long_rope_recomputes"] == 1


@pytest.mark.parametrize("separate_pools", [False, True])
@pytest.mark.parametrize("prompt_len", [ORIGINAL, ORIGINAL - 3])
def test_pd_recomputes_on_the_prefill_side(separate_pools, prompt_len):
    """A prompt of exactly the context crosses with its first token (not handed off: the
    prefill worker recomputes it); a shorter one crosses on the decode worker."""
    prompt = (PROMPT * 2)[:prompt_len]
    h = Harness(build_pd_scheduler(separate_pools=separate_pools, long_rope_context=ORIGINAL))
    h.submit("a", prompt, max_tokens=8, ignore_eos=True)
    h.submit("b", PROMPT * 2, max_tokens=4, ignore_eos=True)
    finish(h)
    assert h.outputs["a"] == reference(prompt, 8) and h.outputs["b"] == reference(PROMPT * 2, 4)
    assert h.scheduler.stats()["num_long_rope_recomputes"] == 1


MODES = {"plain": {}, "overlap": dict(overlap=True), "multi-step": dict(decode_steps=3),
         "ngram": dict(spec="ngram", gamma=3), "draft": dict(draft_model="d.gguf", gamma=3)}


@pytest.mark.parametrize("seed", range(20))
def test_random_traces_around_the_context_give_the_reference_output(seed):
    """Shared prefixes on both sides of the context, small pools (preemption), chunked
    prefill, several workers, priorities, static batching, and overlap, multi-step plans or
    speculative decoding: every output is the reference's."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, V) for _ in range(rng.choice([4, 8, 10]))]
    requests = []
    for i in range(rng.randint(4, 9)):
        prompt = shared[:rng.randint(0, len(shared))] + [rng.randrange(2, V) for _ in range(rng.randint(1, 10))]
        requests.append((f"r{i}", prompt, rng.randint(1, 12)))
    block_size = rng.choice([2, 4])
    biggest = max(-(-(len(p) + n) // block_size) for _, p, n in requests)
    mode = rng.choice(list(MODES))
    proposer = oracle_tree(rng, rng.choice([0.5, 1.0]), (1, 1, 1)) if mode == "draft" else None
    h = Harness(build_scheduler(
        long_rope_context=ORIGINAL, block_size=block_size,
        pool_blocks=rng.choice([biggest + 1, biggest + 8, 64]), num_workers=rng.choice([1, 2]),
        max_seqs=rng.choice([2, 4, 8]), chunk_size=rng.choice([3, 8, 64]),
        max_batched_tokens=rng.choice([8, 32, 256]), policy=rng.choice(["fcfs", "priority"]),
        scheduled=mode != "plain" or rng.random() < 0.7,
        **MODES[mode]), proposer=proposer)
    for rid, prompt, max_tokens in requests:
        h.submit(rid, prompt, max_tokens=max_tokens, ignore_eos=True, priority=rng.randint(0, 2))
    finish(h)
    for rid, prompt, max_tokens in requests:
        assert h.outputs[rid] == reference(prompt, max_tokens), (mode, rid)
