"""Speculative decoding pieces that need no model: config and tree shapes, token trees, n-gram
prompt lookup, the adaptive budget rule, the new protocol fields, the chi-square helper."""
from __future__ import annotations

import array
import re

import numpy as np
import pytest

from justapi.config.sections import ConfigError
from justapi.config.serve import build_config
from justapi.config.spec import SpecConfig
from justapi.scheduler.spec.budget import Acceptance, AcceptanceTracker, draft_levels
from justapi.scheduler.spec.ngram import NgramProposer
from justapi.scheduler.spec.tree import check_tree, depths, follow, keep_depth
from justapi.wire import codec
from justapi.wire.protocol import ProtocolError, StepPlan, StepResult
from tests.support.chi_square import chi2_sf, goodness_of_fit, homogeneity


def token_bytes(tokens: list[int]) -> bytes:
    return array.array("i", tokens).tobytes()


# ------------------------------------------------------------------------------ config


def test_defaults_are_off_and_a_draft_model_selects_the_draft_proposer():
    assert not SpecConfig().is_enabled
    config = SpecConfig(draft_model="d.gguf")
    assert config.spec == "draft" and config.is_enabled and config.is_chain
    assert config.widths == (1, 1, 1, 1) and config.max_nodes == 4


def test_the_default_depth_follows_the_proposer():
    assert SpecConfig(spec="ngram").gamma == 7 and SpecConfig(spec="ngram").max_nodes == 7
    assert SpecConfig(draft_model="d.gguf").gamma == 4
    assert SpecConfig(spec="ngram", gamma=3).gamma == 3 and SpecConfig(spec="ngram", gamma=0).gamma == 7


@pytest.mark.parametrize("fields,message", [
    (dict(spec="medusa"), "spec must be one of"),
    (dict(spec="draft"), "needs draft-model"),
    (dict(spec="ngram", draft_model="d.gguf"), "give either"),
    (dict(gamma=-1), "gamma must be an integer in [0, 32], got -1"),
    (dict(gamma=33), "gamma must be an integer in [0, 32], got 33"),
    (dict(branch=17), "branch must be an integer in [1, 16], got 17"),
    (dict(spec_tree="3,x"), "spec-tree must be"),
    (dict(spec_budget=-1), "spec-budget must be an integer in [0, 128], got -1"),
    (dict(spec_ngram_min=5), "spec-ngram-min must be an integer in [1, 4], got 5"),
])
def test_bad_spec_values_name_the_key(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SpecConfig(**fields)


def test_serve_config_keys_and_combinations():
    config = build_config({"spec": "ngram", "gamma": 6, "branch": 2, "spec-budget": 9}, {})
    assert config.speculative.spec == "ngram" and config.speculative.max_nodes == 9
    with pytest.raises(ConfigError, match="does not combine with pd"):
        build_config({"spec": "ngram", "pd": "1:1"}, {})
    with pytest.raises(ConfigError, match="needs workers = 1"):
        build_config({"draft-model": "d.gguf", "workers": 2}, {})
    assert build_config({"spec": "ngram", "workers": 2}, {}).server.workers == 2


@pytest.mark.parametrize("fields,nodes,depth,sizes", [
    (dict(gamma=4), None, None, [1, 1, 1, 1]),
    (dict(gamma=4), 2, None, [1, 1]),
    (dict(gamma=4, branch=2), None, None, [2, 2, 2, 2]),  # budget 8: a beam of 2
    (dict(gamma=4, branch=2), 4, 2, [2, 2]),
    (dict(gamma=4, branch=2), 3, None, [1, 1, 1]),
    (dict(spec_tree="3,2,1"), None, None, [3, 3, 3]),
    (dict(spec_tree="4,1,1,1", spec_budget=5), None, None, [2, 2, 1]),
])
def test_level_sizes_follow_the_shape_and_the_budget(fields, nodes, depth, sizes):
    config = SpecConfig(spec="ngram", **fields)
    assert config.level_sizes(nodes, depth) == sizes
    assert sum(sizes) <= config.max_nodes


# ------------------------------------------------------------------------------ trees


def test_tree_walks_and_cuts():
    tokens, parents = [10, 11, 12, 13, 14], [-1, -1, 0, 0, 2]
    check_tree(tokens, parents)
    assert depths(parents) == [1, 1, 2, 2, 3]
    assert follow(tokens, parents, [10, 12, 14]) == [0, 2, 4]
    assert follow(tokens, parents, [11]) == [1] and follow(tokens, parents, []) == []
    assert follow(tokens, parents, [10, 14]) is None
    assert keep_depth(tokens, parents, 2) == ([10, 11, 12, 13], [-1, -1, 0, 0])
    assert keep_depth(tokens, parents, 0) == ([], [])


@pytest.mark.parametrize("tokens,parents,message", [
    ([1, 2], [-1], "one parent per token"),
    ([1, 2], [-1, 1], "parents must precede children"),
    ([1, 1], [-1, -1], "repeats token 1 under parent -1"),
])
def test_malformed_trees_are_refused(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        check_tree(tokens, parents)


# ------------------------------------------------------------------------------ n-gram


def test_ngram_chain_continues_the_most_recent_longest_match():
    history = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 0, 2, 3]
    tokens, parents = NgramProposer(1, 3).propose(token_bytes(history), [1, 1, 1], [1, 1, 1])
    assert tokens == [7, 8, 0] and parents == [-1, 0, 1]  # "2 3" last seen before "7 8 0"


def test_ngram_tree_merges_continuations_of_several_matches():
    history = [5, 6, 1, 5, 6, 2, 3, 5, 6, 1, 4, 5, 6]
    tokens, parents = NgramProposer(1, 2).propose(token_bytes(history), [2, 2], [2, 2])
    # "5 6" was followed by 1 4, 2 3 and 1 5: one node per distinct token under a parent
    assert sorted(zip(tokens, parents))[:2] == [(1, -1), (2, -1)]
    check_tree(tokens, parents)
    assert len(tokens) == 4 and all(d <= 2 for d in depths(parents))


def test_ngram_proposes_nothing_without_a_match_and_ignores_misaligned_bytes():
    assert NgramProposer().propose(token_bytes([1, 2, 3, 4]), [1, 1], [1, 1]) == ([], [])
    # 0x01000000 followed by 0x00000001 contains the bytes of 1 at a misaligned offset
    history = [0x01000000, 0x00000001 << 8, 7, 1]
    assert NgramProposer(1, 1).propose(token_bytes(history), [1], [1]) == ([], [])


def test_ngram_at_the_start_of_a_history():
    assert NgramProposer().propose(token_bytes([3]), [1, 1], [1, 1]) == ([], [])
    assert NgramProposer(1, 1).propose(token_bytes([3, 3]), [1, 1], [1, 1]) == ([3], [-1])


# ------------------------------------------------------------------------------ budget rule


def test_budget_takes_every_level_for_one_good_request_and_none_for_a_hopeless_one():
    costs = [1, 1, 1, 1]
    assert draft_levels([0.8], costs, 0, 16.0) == [4]
    assert draft_levels([0.01], costs, 0, 16.0) == [0]
    assert draft_levels([0.8, 0.01], costs, 0, 16.0) == [4, 0]


def test_budget_shrinks_as_the_batch_grows():
    costs = [1, 1, 1, 1]
    levels = [sum(draft_levels([0.7] * b, costs, 0, 16.0)) / b for b in (1, 4, 16, 64)]
    assert levels[0] == 4 and levels == sorted(levels, reverse=True) and levels[-1] < 1
    assert draft_levels([0.7] * 8, costs, 0, 0.0) == [0] * 8  # no fixed cost: never pays


def test_budget_pays_wider_levels_less():
    assert sum(draft_levels([0.6], [4, 4, 4], 0, 16.0)) < sum(draft_levels([0.6], [1, 1, 1], 0, 16.0))


def test_acceptance_estimate_follows_outcomes():
    tracker, own = AcceptanceTracker(), Acceptance()
    start = tracker.alpha(own)
    for _ in range(10):
        tracker.observe(own, 0, 4)
    assert tracker.alpha(own) < 0.2 < start
    for _ in range(10):
        tracker.observe(own, 4, 4)
    assert tracker.alpha(own) > 0.7


# ------------------------------------------------------------------------------ protocol


def test_plan_and_result_carry_trees_and_proposals():
    plan = StepPlan.build(1, [("a", 5, [1, 2, 3, 4], [0, 1], True), ("b", 0, [7], [2], True)])
    plan = StepPlan(**{**plan.__dict__, "num_draft_tokens": np.asarray([3, 0], np.int32),
                       "draft_parents": np.asarray([-1, -1, 0], np.int32),
                       "num_propose": np.asarray([2, 0], np.int32)})
    back = codec.decode(codec.encode(plan))
    assert back.parents_of(0).tolist() == [-1, -1, 0] and back.parents_of(1).tolist() == []
    assert back.propose_counts.tolist() == [2, 0]
    chain = StepPlan(**{**plan.__dict__, "draft_parents": np.zeros(0, np.int32)})
    assert chain.parents_of(0).tolist() == [-1, 0, 1]
    result = StepResult(1, 0, ["a", "b"], np.asarray([1, 1], np.int32), np.asarray([3, 4], np.int32),
                        num_proposed=np.asarray([2, 0], np.int32),
                        proposed_token_ids=np.asarray([8, 9], np.int32),
                        proposed_parents=np.asarray([-1, -1], np.int32))
    assert codec.decode(codec.encode(result)).proposed_parents.tolist() == [-1, -1]


@pytest.mark.parametrize("parents", [[-1, 1, 0], [-2, -1, 0], [-1, -1]])
def test_bad_draft_parents_are_refused(parents):
    plan = StepPlan.build(1, [("a", 5, [1, 2, 3, 4], [0, 1], True)])
    with pytest.raises(ProtocolError, match="draft_parents"):
        StepPlan(**{**plan.__dict__, "num_draft_tokens": np.asarray([3], np.int32),
                    "draft_parents": np.asarray(parents, np.int32)})


# ------------------------------------------------------------------------------ chi-square helper


def test_chi2_survival_matches_tables():
    for x, df, p in [(3.841, 1, 0.05), (11.070, 5, 0.05), (23.209, 10, 0.01), (0.711, 4, 0.95)]:
        assert chi2_sf(x, df) == pytest.approx(p, abs=5e-4)


def test_chi_square_tests_accept_a_fair_sample_and_reject_a_biased_one():
    rng = np.random.default_rng(0)
    probs = {0: 0.5, 1: 0.3, 2: 0.15, 3: 0.05}
    fair = rng.choice(4, size=4000, p=list(probs.values())).tolist()
    biased = rng.choice(4, size=4000, p=[0.45, 0.35, 0.15, 0.05]).tolist()
    assert goodness_of_fit(fair, probs) > 0.01 and goodness_of_fit(biased, probs) < 1e-4
    assert homogeneity(fair[:2000], fair[2000:]) > 0.01 and homogeneity(fair, biased) < 1e-4
