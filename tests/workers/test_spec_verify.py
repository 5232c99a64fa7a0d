"""Verification rules on hand-made distributions (no model): the emitted tokens of speculative
sampling follow the target distribution exactly - chains (Leviathan/Chen), trees (multi-step
speculative sampling) with drafts drawn from q, deterministic drafts (n-gram), trees cut by
the scheduler, filtered targets - checked with chi-square tests (fixed seeds, p > 0.001);
greedy and seeded requests emit plain decoding's own tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from justapi.sampling import SamplingParams
from tests.support.chi_square import goodness_of_fit
from workers.sampler import Sampler, SamplingRow, adjusted_logits, filtered_probs
from workers.spec.verify import NodeDraws, Verifier, VerifyInput

V = 6
N = 3000
P_VALUE = 1e-3
RNG = np.random.default_rng(1234)
TARGET = torch.tensor(RNG.dirichlet(np.ones(V) * 0.8, size=8), dtype=torch.float32)  # rows
DRAFT = torch.tensor(RNG.dirichlet(np.ones(V) * 0.8, size=8), dtype=torch.float32)
HOT = SamplingParams(temperature=1.0, max_tokens=8)


def logits_of(rows: list[int]) -> torch.Tensor:
    return torch.log(TARGET[rows])


def draw(rng: np.random.Generator, q: torch.Tensor, n: int) -> list[int]:
    return rng.choice(V, size=n, p=(q / q.sum()).numpy().astype(np.float64)).tolist()


def build_chain(rng: np.random.Generator, depth: int) -> VerifyInput:
    """Drafts drawn from the draft rows, one per level (row i + 1 is node i's target row)."""
    tokens, draws = [], {}
    for level in range(depth):
        (token,) = draw(rng, DRAFT[level], 1)
        draws[level - 1] = NodeDraws(DRAFT[level], [token])
        tokens.append(token)
    return VerifyInput(logits_of(list(range(depth + 1))), HOT, [1, 2], 2, 1, tokens,
                       list(range(-1, depth - 1)), draws)


def build_tree(rng: np.random.Generator, num_draws: int) -> VerifyInput:
    """Root: num_draws draws from q (unique ones become children, in draw order); each child
    one draw from its own q."""
    root_draws = draw(rng, DRAFT[0], num_draws)
    tokens, parents, draws = [], [], {-1: NodeDraws(DRAFT[0], root_draws)}
    for token in dict.fromkeys(root_draws):
        tokens.append(token)
        parents.append(-1)
    for child in range(len(tokens)):
        q = DRAFT[1 + child]
        (token,) = draw(rng, q, 1)
        draws[child] = NodeDraws(q, [token])
        tokens.append(token)
        parents.append(child)
    return VerifyInput(logits_of(list(range(len(tokens) + 1))), HOT, [1, 2], 2, 1, tokens,
                       parents, draws)


def run(items: list[VerifyInput], seed: int = 0):
    return Verifier(Sampler(seed)).verify(items)


def first_tokens_fit(results, target: torch.Tensor) -> float:
    return goodness_of_fit([r.tokens[0] for r in results], dict(enumerate(target.tolist())))


def test_chain_rejection_sampling_keeps_the_target_distribution():
    rng = np.random.default_rng(0)
    items = [build_chain(rng, 3) for _ in range(N)]
    results = run(items)
    assert first_tokens_fit(results, TARGET[0]) > P_VALUE
    # Whenever the first draft was accepted, the next token follows that node's target row.
    second = [r.tokens[1] for r in results if r.nodes[:1] == [0]]
    assert len(second) > 500
    assert goodness_of_fit(second, dict(enumerate(TARGET[1].tolist()))) > P_VALUE
    assert 0 < sum(len(r.nodes) for r in results) < 3 * N  # some accepted, some rejected


def test_tree_multi_step_sampling_keeps_the_target_distribution():
    rng = np.random.default_rng(1)
    items = [build_tree(rng, 3) for _ in range(N)]
    results = run(items, seed=1)
    assert first_tokens_fit(results, TARGET[0]) > P_VALUE
    # Below an accepted child the child's own row rules (the child's row index is 1 + node).
    by_row: dict[int, list[int]] = {}
    for item, r in zip(items, results):
        if len(r.tokens) > 1:
            by_row.setdefault(1 + r.nodes[0], []).append(r.tokens[1])
    for row, tokens in by_row.items():
        if len(tokens) > 300:
            assert goodness_of_fit(tokens, dict(enumerate(TARGET[row].tolist()))) > P_VALUE
    # More branches accept more often than one draft.
    chain = run([build_chain(rng, 1) for _ in range(N)], seed=2)
    assert sum(bool(r.nodes) for r in results) > sum(bool(r.nodes) for r in chain)


def test_deterministic_drafts_keep_the_target_distribution():
    """n-gram drafts: fixed children, each tried with probability p (then removed from p)."""
    items = [VerifyInput(logits_of([0, 1, 2, 3]), HOT, [1, 2], 2, 1, [4, 1, 3], [-1, -1, 0])
             for _ in range(N)]
    results = run(items, seed=3)
    assert first_tokens_fit(results, TARGET[0]) > P_VALUE
    second = [r.tokens[1] for r in results if r.nodes[:1] == [0]]
    assert goodness_of_fit(second, dict(enumerate(TARGET[1].tolist()))) > P_VALUE


def test_a_drawn_token_whose_node_was_cut_still_counts():
    """The scheduler may cut a proposal (budget, depth): the draws stay trials; accepting one
    whose node is gone ends the step on that token, and the distribution stays exact."""
    rng = np.random.default_rng(4)
    items = []
    for _ in range(N):
        item = build_tree(rng, 3)
        keep = 1  # only the first child survives the cut
        items.append(VerifyInput(item.logits[:keep + 1], HOT, [1, 2], 2, 1, item.tokens[:keep],
                                 item.parents[:keep], {-1: item.draws[-1]}))
    results = run(items, seed=4)
    assert first_tokens_fit(results, TARGET[0]) > P_VALUE
    assert any(len(r.tokens) == 1 and r.tokens[0] != item.tokens[0]
               for item, r in zip(items, results))


def test_filters_penalties_and_logit_bias_apply_to_the_target():
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.95, repetition_penalty=1.3,
                            max_tokens=8, logit_bias={1: 1.5, 4: -100.0})
    history = [3, 5, 3]
    rows = [SamplingRow(params, np.asarray(history), 1, 3)]
    expected = filtered_probs(adjusted_logits(logits_of([0]), rows), [params])[0]
    assert expected[4] == 0 and expected[1] > 0  # the ban and the boost both matter here
    rng = np.random.default_rng(5)
    items = []
    for _ in range(N):
        (token,) = draw(rng, DRAFT[0], 1)
        items.append(VerifyInput(logits_of([0, 1]), params, history, 1, 2, [token], [-1],
                                 {-1: NodeDraws(DRAFT[0], [token])}))
    results = run(items, seed=5)
    assert all(expected[r.tokens[0]] > 0 for r in results)
    probs = {k: v for k, v in enumerate(expected.tolist()) if v > 0}
    assert goodness_of_fit([r.tokens[0] for r in results], probs) > P_VALUE


def test_a_biased_rule_would_be_caught():
    """The test's power: the rule applied with a q other than the one the drafts were drawn
    from (here uniform) is biased, and the test sees it. (Treating a drawn draft as
    deterministic - accept with p(x), else remove x - is exact, only less efficient.)"""
    rng = np.random.default_rng(6)
    uniform = torch.full((V,), 1.0 / V)
    items = [build_chain(rng, 1) for _ in range(N)]
    biased = [VerifyInput(i.logits, i.params, i.history, i.num_prompt_tokens, i.root_position,
                          i.tokens, i.parents, {-1: NodeDraws(uniform, i.tokens[:1])})
              for i in items]
    assert first_tokens_fit(run(biased, seed=6), TARGET[0]) < P_VALUE


# ------------------------------------------------------------------------------ greedy / seeded


def test_greedy_follows_the_argmax_path_through_the_tree():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1).tolist()
    wrong = (best[0] + 1) % V
    tokens, parents = [wrong, best[0], best[2], (best[2] + 1) % V], [-1, -1, 1, 1]
    item = VerifyInput(logits, SamplingParams(temperature=0.0), [1], 1, 0, tokens, parents)
    (result,) = run([item])
    assert result.nodes == [1, 2] and result.tokens == [best[0], best[2], best[3]]
    assert result.rows == [0, 2, 3]


def test_greedy_verification_follows_the_biased_argmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    forced = int(logits[0].argmin())
    params = SamplingParams(temperature=0.0, logit_bias={forced: 100.0})
    (result,) = run([VerifyInput(logits, params, [1], 1, 0, [forced, forced], [-1, 0])])
    assert result.tokens == [forced] * 3  # both drafts accepted, the bonus token forced too
    unbiased = int(logits[0].argmax())
    (result,) = run([VerifyInput(logits[:2], params, [1], 1, 0, [unbiased], [-1])])
    assert result.tokens == [forced]  # the model's own favourite is rejected


@pytest.mark.parametrize("seed", [3, 11])
def test_seeded_verification_emits_plain_decodings_tokens(seed):
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(seed))
    plain = Sampler(0).sample(logits, [SamplingRow(params, np.zeros(0), 1, 10 + r) for r in range(4)])
    target = plain.token_ids.tolist()  # row r's token, at position 10 + r
    chain = VerifyInput(logits, params, [1] * 10, 1, 9, target[:3], [-1, 0, 1])
    (result,) = run([chain], seed=99)
    assert result.tokens == target  # every draft right: all accepted + the bonus
    other = VerifyInput(logits[:2], params, [1] * 10, 1, 9, [(target[0] + 1) % V], [-1])
    (result,) = run([other], seed=7)
    assert result.tokens == target[:1]
