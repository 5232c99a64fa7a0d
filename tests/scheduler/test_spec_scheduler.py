"""Speculative decoding in the scheduler core, with plan-checking fake workers: n-gram drafts,
token trees, a draft model's proposals and look-ahead blocks, rollback, the adaptive budget,
statistics - and random traces (tiny pools, preemption, aborts, prefix sharing) whose outputs
must equal the reference model's, with the invariants checked after every event."""
from __future__ import annotations

import array
import dataclasses
import random

import numpy as np
import pytest

from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.scheduler.spec.ngram import NgramProposer

V = 64
REF = ReferenceModel(V)
PROMPT = [2 + (i * 11) % 60 for i in range(7)]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    return REF.generate(prompt, max_tokens, frozenset(), 10_000)[0]


def oracle_tree(rng: random.Random, p_right: float, widths: tuple[int, ...] = (2, 2, 1)):
    """A fake draft model: a BFS-ordered token tree whose nodes continue the reference model's
    output with probability p_right each (the right child at a random place among wrong ones)."""
    def propose(rid: str, known: list[int], num_propose: int) -> tuple[list[int], list[int]]:
        tokens, parents, paths = [], [], {-1: list(known)}
        frontier = [-1]
        for width in widths:
            level = []
            for node in frontier:
                truth = REF.next_token(paths[node])
                kids = [truth if rng.random() < p_right else (truth + 1) % V]
                kids += [t for t in rng.sample(range(2, V), width + 2) if t not in kids][:width - 1]
                rng.shuffle(kids)
                for token in kids:
                    if len(tokens) == num_propose:
                        return tokens, parents
                    tokens.append(token)
                    parents.append(node)
                    paths[len(tokens) - 1] = paths[node] + [token]
                    level.append(len(tokens) - 1)
            frontier = level
        return tokens, parents
    return propose


def run_one(harness: Harness, prompt: list[int], max_tokens: int) -> list[int]:
    harness.submit("a", prompt, max_tokens=max_tokens, ignore_eos=True)
    harness.run()
    return harness.outputs["a"]


# ------------------------------------------------------------------------------ n-gram


def test_ngram_drafts_come_from_the_request_and_keep_the_output():
    prompt = list(range(2, 62))  # holds (almost) every token: the first output token matches
    h = Harness(build_scheduler(block_size=4, spec="ngram", gamma=3, spec_adaptive=False))
    h.submit("a", prompt, max_tokens=12, ignore_eos=True)
    h.step()  # prefill: the first output token
    history = prompt + reference(prompt, 1)
    expected, _ = NgramProposer(1, 4).propose(array.array("i", history).tobytes(), [1, 1, 1],
                                             [1, 1, 1])
    assert len(expected) == 3
    (_, plan), = h.schedule()
    assert plan.num_draft_tokens.tolist() == [3]
    assert plan.token_ids.tolist() == history[-1:] + expected
    h.complete(0, plan)
    h.run()
    assert h.outputs["a"] == reference(prompt, 12)
    stats = h.scheduler.stats()
    assert stats["spec_decode_num_drafts"] >= 1 and stats["spec_decode_num_draft_tokens"] >= 3


def test_ngram_trees_with_several_shapes_keep_the_output():
    prompt = [5, 6, 1, 5, 6, 2, 3, 5, 6, 1, 4, 5, 6] * 2
    for shape in ("2,2", "3,1,1", "1,1,1,1,1"):
        h = Harness(build_scheduler(block_size=4, spec="ngram", spec_tree=shape, spec_adaptive=False))
        assert run_one(h, prompt, 20) == reference(prompt, 20), shape
        assert h.scheduler.stats()["spec_decode_num_draft_tokens"] > 0


# ------------------------------------------------------------------------------ token trees


def test_a_tree_path_off_the_first_branch_is_accepted_and_rolled_back_exactly():
    # Speculation on (its counters), no proposer: the drafts are the test's own.
    h = Harness(build_scheduler(block_size=4, pool_blocks=32, enable_prefix_cache=False,
                                draft_model="d.gguf", spec_adaptive=False))
    h.submit("a", PROMPT, max_tokens=30, ignore_eos=True)
    h.step()
    free = reference(PROMPT, 30)
    req = h.scheduler.request("a")
    wrong = (free[1] + 1) % V
    # root -+- wrong -- x        the right path is node 1 -> node 3 -> node 4 (depth 3)
    #       +- free[1] -+- free[2] -- free[3]
    tokens = [wrong, free[1], 9 if free[2] != 9 else 8, free[2], free[3]]
    assert h.scheduler.set_draft_tokens("a", tokens, [-1, -1, 0, 1, 3]) == 5
    (worker_id, plan), = h.schedule()
    assert plan.draft_parents.tolist() == [-1, -1, 0, 1, 3] and plan.num_tokens.tolist() == [6]
    deltas = h.complete(worker_id, plan)
    assert deltas.token_ids.tolist() == free[1:5]  # three accepted drafts + the bonus token
    assert req.num_computed_tokens == len(PROMPT) + 4 and req.num_tokens == len(PROMPT) + 5
    assert len(req.block_ids) == -(-req.num_computed_tokens // 4)
    h.run()
    assert h.outputs["a"] == free
    stats = h.scheduler.stats()
    assert stats["spec_decode_num_accepted_tokens"] == 3 and stats["spec_decode_num_drafts"] == 1
    assert [stats[f"spec_decode_num_accepted_tokens_pos_{i}"] for i in range(4)] == [1, 1, 1, 0]
    assert stats["spec_decode_mean_acceptance_length"] == 4.0


def test_drafts_that_name_no_tree_path_fail_the_request_cleanly():
    h = Harness(build_scheduler(block_size=4))
    h.submit("a", PROMPT, max_tokens=30, ignore_eos=True)
    h.step()
    h.scheduler.set_draft_tokens("a", [3, 4], [-1, -1])
    (worker_id, plan), = h.schedule()
    result = h.workers[worker_id].execute(plan)
    forged = dataclasses.replace(result, num_sampled=np.asarray([3], np.int32),
                                 sampled_token_ids=np.asarray([4, 3, 5], np.int32))
    deltas = h.scheduler.update(forged)
    assert deltas.finish_reasons == ["error"] and "do not verify" in deltas.errors["a"]
    h.scheduler.check_invariants()
    assert h.scheduler.stats()["kv_blocks_in_use"] == 0


# ------------------------------------------------------------------------------ draft model


def test_a_draft_model_proposes_into_look_ahead_blocks_and_its_drafts_come_back():
    rng = random.Random(1)
    h = Harness(build_scheduler(block_size=4, pool_blocks=64, draft_model="d.gguf", gamma=3,
                                spec_adaptive=False),
                proposer=oracle_tree(rng, 1.0, (1, 1, 1)))
    h.submit("a", PROMPT, max_tokens=20, ignore_eos=True)
    (worker_id, plan), = h.schedule()
    assert plan.num_propose.tolist() == [3]
    assert plan.num_blocks.tolist() == [-(-(len(PROMPT) + 3) // 4)]  # prompt + look-ahead
    h.complete(worker_id, plan)
    req = h.scheduler.request("a")
    assert len(req.draft_token_ids) == 3 and req.draft_parents == []
    (worker_id, plan), = h.schedule()
    assert plan.num_draft_tokens.tolist() == [3] and plan.num_propose.tolist() == [3]
    h.complete(worker_id, plan)
    h.run()
    assert h.outputs["a"] == reference(PROMPT, 20)
    stats = h.scheduler.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def test_look_ahead_never_preempts():
    rng = random.Random(2)
    h = Harness(build_scheduler(block_size=4, pool_blocks=4, draft_model="d.gguf", gamma=4,
                                spec_adaptive=False, max_context=16),
                proposer=oracle_tree(rng, 0.5, (1, 1, 1, 1)))
    h.submit("a", PROMPT[:6], max_tokens=9, ignore_eos=True)
    h.run()
    assert h.outputs["a"] == reference(PROMPT[:6], 9)
    assert h.scheduler.stats()["num_preemptions"] == 0


def test_the_adaptive_rule_stops_proposing_hopeless_drafts():
    rng = random.Random(3)
    h = Harness(build_scheduler(block_size=4, pool_blocks=64, draft_model="d.gguf", gamma=4),
                proposer=oracle_tree(rng, 0.0, (1, 1, 1, 1)))
    assert run_one(h, PROMPT, 60) == reference(PROMPT, 60)
    stats = h.scheduler.stats()
    assert stats["spec_decode_num_accepted_tokens"] == 0
    assert stats["spec_decode_num_draft_tokens"] < 0.25 * 4 * 60  # probes only, after a few steps


def test_the_adaptive_rule_keeps_proposing_good_drafts():
    rng = random.Random(4)
    h = Harness(build_scheduler(block_size=4, pool_blocks=64, draft_model="d.gguf", gamma=4),
                proposer=oracle_tree(rng, 0.95, (1, 1, 1, 1)))
    assert run_one(h, PROMPT, 60) == reference(PROMPT, 60)
    stats = h.scheduler.stats()
    assert stats["spec_decode_mean_acceptance_length"] > 3.0
    assert stats["spec_decode_mean_budget_levels"] > 3.5


# ------------------------------------------------------------------------------ random traces


def random_run(seed: int, spec: dict, widths: tuple[int, ...]) -> None:
    rng = random.Random(seed)
    shared = [rng.randrange(2, V) for _ in range(rng.choice([0, 6]))]
    requests = []
    for i in range(rng.randint(3, 8)):
        prompt = shared + [rng.randrange(2, V) for _ in range(rng.randint(1, 9))]
        if rng.random() < 0.5:
            prompt = prompt * 2  # repetition for the n-gram proposer
        requests.append((f"r{i}", prompt, rng.randint(1, 14)))
    block_size = rng.choice([2, 4])
    biggest = max(-(-(len(p) + n) // block_size) for _, p, n in requests)
    options = dict(block_size=block_size, pool_blocks=rng.choice([biggest, biggest + 6, 64]),
                   num_workers=rng.choice([1, 2]), max_seqs=rng.choice([2, 4, 8]),
                   chunk_size=rng.choice([3, 8, 64]), max_batched_tokens=rng.choice([8, 32, 256]),
                   enable_prefix_cache=rng.random() < 0.7, **spec)
    proposer = oracle_tree(rng, rng.choice([0.3, 0.8]), widths) if "draft_model" in spec else None
    h = Harness(build_scheduler(**options), proposer=proposer)
    expected = {}
    for rid, prompt, max_tokens in requests:
        h.submit(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
        expected[rid] = reference(prompt, max_tokens)
    aborted = set()
    for _ in range(2000):
        if not h.scheduler.has_work():
            break
        if rng.random() < 0.03 and h.scheduler.state.requests:
            rid = rng.choice(sorted(h.scheduler.state.requests))
            aborted.add(rid)
            h.abort(rid)
        h.step()
    assert not h.scheduler.has_work()
    for rid, output in expected.items():
        if rid in aborted:
            assert h.outputs[rid] == output[:len(h.outputs[rid])]
        else:
            assert h.outputs[rid] == output, rid
            assert h.finish_reasons[rid] == "length"
    assert h.scheduler.stats()["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("seed", range(30))
def test_random_traces_with_a_draft_model(seed):
    widths = [(1, 1, 1), (2, 2, 1), (3, 1)][seed % 3]
    random_run(seed, dict(draft_model="d.gguf", spec_tree=",".join(map(str, widths)),
                          spec_adaptive=seed % 2 == 0), widths)


@pytest.mark.parametrize("seed", range(30))
def test_random_traces_with_ngram(seed):
    random_run(100 + seed, dict(spec="ngram", gamma=1 + seed % 4, branch=1 + seed % 3,
                                spec_adaptive=seed % 2 == 1), ())
