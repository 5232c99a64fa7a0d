"""Pooling (embedding) requests in the scheduler core: prefill-only chunks that are never
sampled, batched with generation, finished with the worker's pooled state of exactly their
prompt; last-token pooling takes prefix-cache hits, mean pooling computes every position;
nothing stays held afterwards; preemption and overlap change nothing."""
from __future__ import annotations

import random

import numpy as np
import pytest

from justapi.scheduler.sim.fake_model import ReferenceModel, pooled_state
from justapi.scheduler.sim.harness import Harness, build_scheduler
from tests.support import sim_prompts

VOCAB = 64


def expected_state(prompt: list[int]) -> np.ndarray:
    return pooled_state(ReferenceModel(VOCAB).chain(prompt)[-1])


@pytest.mark.parametrize("overlap", [False, True])
def test_pooling_requests_finish_with_their_prompts_pooled_state(overlap):
    h = Harness(build_scheduler(pool_blocks=64, chunk_size=5, max_seqs=6, overlap=overlap))
    shared = sim_prompts.prompt(12, 3, stride=3)
    prompts = {"gen": shared + [9, 8], "last-a": shared + [7], "last-b": shared + [6, 5, 4],
               "mean": shared + [2], "cls": sim_prompts.prompt(7, 40, stride=3)}
    h.submit("gen", prompts["gen"], max_tokens=6, ignore_eos=True)
    h.run()  # caches the shared prefix
    for rid in ("last-a", "last-b"):
        h.submit(rid, prompts[rid], pooling="last")
    h.submit("mean", prompts["mean"], pooling="mean")
    h.submit("cls", prompts["cls"], pooling="cls")
    h.submit("gen-2", prompts["gen"], max_tokens=4, ignore_eos=True)
    h.run()
    for rid in ("last-a", "last-b", "mean", "cls"):
        assert h.finish_reasons[rid] == "stop" and h.outputs[rid] == []
        assert np.array_equal(h.embeddings[rid], expected_state(prompts[rid]))
    assert h.cached_tokens["last-a"] == 12 and h.cached_tokens["last-b"] == 12
    assert h.cached_tokens.get("mean", 0) == 0  # every position computed (FakeWorker checks)
    assert h.outputs["gen-2"] == h.outputs["gen"][:4]
    state = h.scheduler.state
    assert not state.requests and state.pool.num_in_use(0) == 0


def test_a_prompt_filling_the_context_can_be_embedded_but_not_generated():
    h = Harness(build_scheduler(max_context=16))
    h.submit("e", sim_prompts.prompt(16, 3, stride=3), pooling="last")
    with pytest.raises(ValueError, match="no room"):
        h.submit("g", sim_prompts.prompt(16, 3, stride=3), max_tokens=1)
    h.run()
    assert h.finish_reasons["e"] == "stop"


def test_random_mixes_with_preemption_give_every_request_its_reference_result():
    rng = random.Random(5)
    model = ReferenceModel(VOCAB)
    for overlap in (False, True):
        h = Harness(build_scheduler(pool_blocks=9, chunk_size=rng.choice([3, 8]), max_seqs=4,
                                    overlap=overlap))
        prompts: dict[str, list[int]] = {}
        for i in range(40):
            base = rng.choice([3, 3, 17])
            prompt = sim_prompts.prompt(rng.randint(2, 14), base, stride=3)
            rid = f"r{i}"
            prompts[rid] = prompt
            pooling = rng.choice(["", "last", "mean"])
            h.submit(rid, prompt, max_tokens=rng.randint(1, 16), ignore_eos=True, pooling=pooling)
            if rng.random() < 0.4:
                h.step()
        h.run()
        for rid, prompt in prompts.items():
            if rid in h.embeddings:
                assert np.array_equal(h.embeddings[rid], expected_state(prompt))
            else:
                out, _ = model.generate(prompt, 16, frozenset(), 1024)
                assert h.outputs[rid] == out[:len(h.outputs[rid])] and h.outputs[rid]
        assert len(h.embeddings) > 5 and h.scheduler.state.pool.num_in_use(0) == 0
        assert h.scheduler.state.counters.num_preemptions > 0
