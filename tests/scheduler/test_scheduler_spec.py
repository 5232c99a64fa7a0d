"""Draft tokens under the one rule: counted, verified, rolled back with exact block frees."""
from __future__ import annotations

import pytest

from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.harness import Harness, build_scheduler

V = 64
REF = ReferenceModel(V)
PROMPT = [2 + (i * 11) % 60 for i in range(7)]
FREE_RUN = REF.generate(PROMPT, 30, frozenset(), 10_000)[0]


def wrong(token: int) -> int:
    return 2 + (token + 1) % 60


def started(**kw) -> Harness:
    h = Harness(build_scheduler(block_size=4, pool_blocks=32, enable_prefix_cache=False))
    h.submit("a", PROMPT, max_tokens=30, ignore_eos=True, **kw)
    h.step()  # prefill: 7 computed, 8 known (the first output token)
    return h


def test_rejected_drafts_roll_back_and_free_only_their_blocks():
    h = started()
    req = h.scheduler.request("a")
    o = FREE_RUN
    assert h.scheduler.set_draft_tokens("a", [o[1], wrong(o[2]), 5, 6, 7]) == 5
    assert req.num_tokens_wanted == 6  # the last known token + 5 drafts
    (worker_id, plan), = h.schedule()
    assert plan.num_draft_tokens.tolist() == [5] and plan.num_tokens.tolist() == [6]
    assert plan.token_ids.tolist() == [o[0], o[1], wrong(o[2]), 5, 6, 7]
    assert len(req.block_ids) == 4  # positions 7..12 reach into a 4th block
    in_use = h.scheduler.stats()["kv_blocks_in_use"]
    deltas = h.complete(worker_id, plan)
    assert deltas.token_ids.tolist() == [o[1], o[2]]  # one accepted draft + the correction
    assert req.num_computed_tokens == 9 and req.num_tokens == 10
    assert len(req.block_ids) == 3  # the block of rejected drafts only is freed
    assert h.scheduler.stats()["kv_blocks_in_use"] == in_use - 1
    h.run()
    assert h.outputs["a"] == FREE_RUN
    stats = h.scheduler.stats()
    assert stats["num_draft_tokens"] == 5 and stats["num_accepted_draft_tokens"] == 1


def test_all_drafts_accepted_yield_a_bonus_token():
    h = started()
    h.scheduler.set_draft_tokens("a", FREE_RUN[1:4])
    (worker_id, plan), = h.schedule()
    deltas = h.complete(worker_id, plan)
    assert deltas.token_ids.tolist() == FREE_RUN[1:5]
    h.run()
    assert h.outputs["a"] == FREE_RUN


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there():
    h = started(stop_token_ids=[FREE_RUN[2]])
    assert FREE_RUN[2] not in FREE_RUN[:2]
    h.scheduler.set_draft_tokens("a", FREE_RUN[1:4])
    (worker_id, plan), = h.schedule()
    deltas = h.complete(worker_id, plan)
    assert deltas.token_ids.tolist() == FREE_RUN[1:3] and deltas.finish_reasons == ["stop"]
    assert h.scheduler.stats()["kv_blocks_in_use"] == 0


def test_drafts_are_capped_by_the_context_and_max_tokens():
    h = Harness(build_scheduler(block_size=4, max_context=10))
    h.submit("a", PROMPT, max_tokens=30, ignore_eos=True)
    h.submit("b", PROMPT, max_tokens=2, ignore_eos=True, cache_salt="b")  # does not wait for a's prompt
    h.step()
    assert h.scheduler.set_draft_tokens("a", [3] * 8) == 2  # positions up to 9 only
    assert h.scheduler.set_draft_tokens("b", [3] * 8) == 1  # 2 outputs at most
    h.run()
    assert h.outputs["a"] == FREE_RUN[:3] and h.finish_reasons["a"] == "length"
    assert h.outputs["b"] == FREE_RUN[:2]


def test_drafts_only_between_steps_of_a_decoding_request():
    h = Harness(build_scheduler(block_size=4, chunk_size=4))
    h.submit("a", PROMPT, max_tokens=5)
    with pytest.raises(ValueError, match="not running"):
        h.scheduler.set_draft_tokens("a", [3])
    h.step()
    with pytest.raises(ValueError, match="prefilling"):
        h.scheduler.set_draft_tokens("a", [3])
    h.step()
    h.schedule()
    with pytest.raises(ValueError, match="not running between steps"):
        h.scheduler.set_draft_tokens("a", [3])
