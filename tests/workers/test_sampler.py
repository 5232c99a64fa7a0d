"""The batched sampler: seeded streams independent of the batch, exact filter sets, exact
penalties, raw logprobs, and sampled frequencies that match the target distribution."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from justapi.sampling import SamplingParams
from workers.sampler import (
    Sampler,
    SamplingRow,
    adjusted_logits,
    apply_penalties,
    filtered_probs,
    stream_seed,
)


def row(params: SamplingParams, position: int = 0, tokens=(), num_prompt: int = 0) -> SamplingRow:
    return SamplingRow(params, np.asarray(tokens, dtype=np.int64), num_prompt, position)


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Upper tail of the chi-square distribution (regularized incomplete gamma, by series)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    a, x = (len(observed) - 1) / 2.0, stat / 2.0
    term = total = 1.0 / a
    for n in range(1, 1000):
        term *= x / (a + n)
        total += term
        if term < total * 1e-15:
            break
    lower = total * math.exp(-x + a * math.log(x) - math.lgamma(a)) if x > 0 else 0.0
    return 1.0 - lower


def sample_many(logits: torch.Tensor, params: SamplingParams, num: int) -> np.ndarray:
    """num draws: one row per draw, positions 0..num-1 give independent seeded streams."""
    rows = [row(params, position=i) for i in range(num)]
    return Sampler(seed=0).sample(logits.expand(num, -1).clone(), rows).token_ids


LOGITS = torch.tensor([1.5, 0.2, -0.3, 2.0, 0.9, -1.0, 0.0, 1.1])


@pytest.mark.parametrize("params,keep", [
    (SamplingParams(temperature=1.0, seed=5), None),
    (SamplingParams(temperature=0.6, seed=6), None),
    (SamplingParams(temperature=1.3, top_k=4, seed=7), 4),
])
def test_frequencies_match_the_softmax(params, keep):
    num = 6000
    counts = np.bincount(sample_many(LOGITS, params, num), minlength=len(LOGITS))
    probs = torch.softmax(LOGITS / params.temperature, dim=-1).numpy().astype(np.float64)
    if keep:
        kept = np.argsort(-probs)[:keep]
        assert counts[np.setdiff1d(np.arange(len(probs)), kept)].sum() == 0
        probs, counts = probs[kept] / probs[kept].sum(), counts[kept]
    p_value = chi_square_p_value(counts, probs * num)
    assert p_value > 1e-3, (counts, probs * num)


def test_chi_square_detects_a_wrong_distribution():
    # the same draws judged against the untempered softmax must be rejected
    counts = np.bincount(sample_many(LOGITS, SamplingParams(temperature=0.6, seed=6), 6000), minlength=8)
    wrong = torch.softmax(LOGITS, dim=-1).numpy().astype(np.float64) * 6000
    assert chi_square_p_value(counts, wrong) < 1e-6


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    vocab = 500
    target = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    logits = torch.randn(40, vocab)
    alone = [int(Sampler().sample(logits[i:i + 1], [row(target, position=i)]).token_ids[0])
             for i in range(40)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, seed=99, top_k=5)]
    batched = []
    for i in range(40):
        batch_rows = [row(others[(i + j) % 3], position=i) for j in range(i % 4)]
        where = len(batch_rows) // 2
        batch_rows.insert(where, row(target, position=i))
        batch = torch.randn(len(batch_rows), vocab)
        batch[where] = logits[i]
        batched.append(int(Sampler(seed=i).sample(batch, batch_rows).token_ids[where]))
    assert batched == alone
    other_seed = [int(Sampler().sample(logits[i:i + 1], [row(SamplingParams(temperature=0.9, top_p=0.9,
                                                                          seed=4321), position=i)]).token_ids[0])
                  for i in range(40)]
    assert other_seed != alone


def test_stream_seed_mixes_seed_and_position():
    seeds = {stream_seed(s, p) for s in range(20) for p in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


def test_top_k_1_and_temperature_0_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, 300)
    rows = [row(SamplingParams(temperature=1.5, top_k=1), i) if i % 2 else row(SamplingParams(temperature=0.0), i)
            for i in range(16)]
    assert Sampler(seed=3).sample(logits, rows).token_ids.tolist() == logits.argmax(-1).tolist()


PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])


@pytest.mark.parametrize("params,kept", [
    (SamplingParams(top_p=0.7), {0, 1}),
    (SamplingParams(top_p=0.8), {0, 1, 2}),
    (SamplingParams(top_p=0.95), {0, 1, 2, 3}),
    (SamplingParams(top_p=0.3), {0}),
    (SamplingParams(min_p=0.4), {0, 1}),
    (SamplingParams(min_p=0.25), {0, 1, 2}),
    (SamplingParams(min_p=0.1), {0, 1, 2, 3}),
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_k=2, top_p=0.95), {0, 1}),
    (SamplingParams(top_k=4, top_p=0.8, min_p=0.2), {0, 1}),
])
def test_filters_keep_exactly_the_right_sets(params, kept):
    logits = PROBS.log()[None, :]
    probs = filtered_probs(logits, [params])[0]
    assert set(torch.nonzero(probs).flatten().tolist()) == kept
    expected = torch.zeros(5)
    expected[list(kept)] = PROBS[list(kept)] / PROBS[list(kept)].sum()
    torch.testing.assert_close(probs, expected)


def test_filters_apply_per_row():
    logits = PROBS.log().expand(3, -1).clone()
    params = [SamplingParams(top_p=0.7), SamplingParams(), SamplingParams(top_k=1, temperature=1.0)]
    probs = filtered_probs(logits, params)
    assert (probs > 0).sum(dim=1).tolist() == [2, 5, 1]


def test_temperature_is_applied_before_the_filters():
    # at T=2 the distribution flattens: top_p=0.7 needs three tokens instead of two
    logits = PROBS.log()[None, :]
    probs = filtered_probs(logits, [SamplingParams(top_p=0.7, temperature=2.0)])[0]
    assert set(torch.nonzero(probs).flatten().tolist()) == {0, 1, 2}


def test_penalties_change_logits_exactly_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [0, 1], output [3, 3, 2]; token 5 never appears
    out = apply_penalties(logits, [row(params, tokens=[0, 1, 3, 3, 2], num_prompt=2)])
    # repetition on 0..3 (prompt + output): 2/2, -1*2, 0.5/2, 3/2; then output-only penalties:
    # token 3 (twice): 1.5 - 0.25*2 - 0.5; token 2 (once): 0.25 - 0.25 - 0.5
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, -0.5, 0.5, -2.0, 1.0]]))
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]))  # input untouched


def test_penalties_only_touch_rows_that_ask():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [row(SamplingParams(), tokens=[2, 2], num_prompt=0),
            row(SamplingParams(frequency_penalty=1.5), tokens=[2, 2], num_prompt=0)]
    out = apply_penalties(logits, rows)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 0.0]]))


def test_greedy_sees_penalties():
    logits = torch.tensor([[1.0, 0.9, 0.1]])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    out = Sampler().sample(logits, [row(params, tokens=[1, 0], num_prompt=1)])
    assert out.token_ids.tolist() == [1]


def test_logprobs_are_raw_and_padded():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    rows = [row(SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5, seed=1), 0, [4, 5], 2),
            row(SamplingParams(temperature=0.0, logprobs=0), 1),
            row(SamplingParams(temperature=0.0), 2)]
    out = Sampler().sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(raw[i, token]), abs=1e-6)
    values, ids = raw[0].topk(3)
    assert out.top_ids[0].tolist() == ids.tolist()
    np.testing.assert_allclose(out.top_logprobs[0], values.numpy(), atol=1e-6)
    assert out.top_ids.shape == (3, 3)
    assert out.top_ids[1].tolist() == [-1, -1, -1] and np.all(np.isneginf(out.top_logprobs[1]))


def test_no_logprobs_when_none_asked():
    out = Sampler().sample(torch.randn(2, 10), [row(SamplingParams()), row(SamplingParams(temperature=0))])
    assert out.logprobs is None and out.top_ids is None


def test_logit_bias_is_added_before_penalties_and_steers_greedy_and_sampled_rows():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [2.0, 1.0, 0.5, -1.0]])
    biased = SamplingParams(temperature=0.0, logit_bias={0: -100.0, 3: 2.5}, repetition_penalty=2.0)
    rows = [row(biased, tokens=[3], num_prompt=1), row(SamplingParams(temperature=0.0))]
    out = adjusted_logits(logits, rows)
    # row 0: token 0 -> 2 - 100 = -98, then repetition (seen: 3) -> 3 (-1 + 2.5 = 1.5) / 2
    torch.testing.assert_close(out, torch.tensor([[-98.0, 1.0, 0.5, 0.75], [2.0, 1.0, 0.5, -1.0]]))
    sampled = Sampler(0).sample(logits, rows)
    assert sampled.token_ids.tolist() == [1, 0]
    forced = SamplingParams(temperature=1.0, seed=4, logit_bias={3: 100.0})
    assert set(sample_many(logits[0], forced, 200).tolist()) == {3}


def test_logit_bias_keeps_logprobs_raw_and_skips_ids_past_the_vocabulary():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias={0: 50.0, 7: 100.0})
    out = Sampler().sample(logits, [row(params)])
    assert out.token_ids.tolist() == [0]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 0]))


def test_logit_bias_params_are_validated_and_travel_as_pairs():
    params = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert params.logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams.from_dict(params.to_dict()) == params
    for bad in ({"9": 1}, {9: 100.5}, {-1: 0}, [[1, 2, 3]], [[1, 0], [1, 1]], {True: 1},
                {1: float("nan")}, dict.fromkeys(range(2000), 1.0), "x"):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
