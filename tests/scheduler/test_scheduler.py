"""Scheduler core: admission, chunked prefill, budgets, decode-first, finishing, prefix cache."""
from __future__ import annotations

import numpy as np
import pytest

from justapi.sampling import SamplingParams
from justapi.scheduler.sim.harness import Harness, build_scheduler
from justapi.wire.protocol import StepResult, SubmitRequest
from tests.support import sim_prompts
from tests.support.sim_prompts import REF, V


def prompt(n: int, base: int = 2) -> list[int]:
    return sim_prompts.prompt(n, base, stride=7)


def expected(p: list[int], max_tokens: int, stop=frozenset({1}), max_len: int = 1024):
    return REF.generate(p, max_tokens, stop, max_len)


# ---------------------------------------------------------------------- add_request
@pytest.mark.parametrize("tokens, match", [
    ([], "non-empty"),
    ([-3, 4], "int32 values >= 0"),
    (list(range(2, 40)), "no room for output"),
])
def test_add_request_rejects_bad_prompts(tokens, match):
    sched = build_scheduler(max_context=32)
    with pytest.raises(ValueError, match=match):
        sched.add_request(SubmitRequest("r", np.asarray(tokens, dtype=np.int32), SamplingParams()))


def test_add_request_rejects_prompt_larger_than_pool_and_duplicate_ids():
    sched = build_scheduler(pool_blocks=4, block_size=4)  # 16 tokens of KV
    with pytest.raises(ValueError, match="needs 5 KV blocks, the largest pool has 4"):
        sched.add_request(SubmitRequest("big", np.arange(2, 18, dtype=np.int32), SamplingParams()))
    sched.add_request(SubmitRequest("ok", np.arange(2, 17, dtype=np.int32), SamplingParams()))
    with pytest.raises(ValueError, match="already in flight"):
        sched.add_request(SubmitRequest("ok", np.arange(2, 5, dtype=np.int32), SamplingParams()))


# ---------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_then_decode_with_exact_positions_and_tables():
    h = Harness(build_scheduler(chunk_size=8, block_size=4))
    p = prompt(20)
    h.submit("a", p, max_tokens=3, ignore_eos=True)
    plans = [h.step()[0][1] for _ in range(5)]
    assert [int(x.start_positions[0]) for x in plans] == [0, 8, 16, 20, 21]
    assert [int(x.num_tokens[0]) for x in plans] == [8, 8, 4, 1, 1]
    assert [bool(x.sample_flags[0]) for x in plans] == [False, False, True, True, True]
    assert [int(x.num_blocks[0]) for x in plans] == [2, 4, 5, 6, 6]
    assert len(plans[0].new_requests) == 1 and not any(x.new_requests for x in plans[1:])
    assert plans[0].new_requests[0].token_ids.tolist() == p
    assert plans[4].finished_request_ids == [] and h.finish_reasons == {"a": "length"}
    assert h.outputs["a"] == expected(p, 3, frozenset())[0]
    last = h.step()  # the worker is told to drop the finished request
    assert last[0][1].num_seqs == 0 and last[0][1].finished_request_ids == ["a"]
    assert not h.scheduler.has_work()


def test_max_prefill_and_token_budget_bound_a_step():
    h = Harness(build_scheduler(max_prefill=4, chunk_size=16, max_batched_tokens=40))
    for i in range(6):
        h.submit(f"r{i}", prompt(30, base=2 + i), ignore_eos=True)
    (_, plan), = h.schedule()
    assert plan.request_ids == ["r0", "r1", "r2"]  # 16 + 16 + 8 = the 40-token budget
    assert plan.num_tokens.tolist() == [16, 16, 8]


def test_decodes_go_first_and_prefills_never_take_their_budget():
    h = Harness(build_scheduler(chunk_size=64, max_batched_tokens=10))
    for i in range(3):
        h.submit(f"d{i}", prompt(4, base=10 + i), max_tokens=20, ignore_eos=True)
    h.step()  # all three prefilled together (12 tokens > budget: two fit, then the third)
    h.step()
    assert all(h.outputs[f"d{i}"] for i in range(3))
    h.submit("long", prompt(50), ignore_eos=True)
    (_, plan), = h.schedule()
    assert plan.request_ids == ["d0", "d1", "d2", "long"]
    assert plan.num_tokens.tolist() == [1, 1, 1, 7]


def test_max_decode_rotates_so_no_decode_starves():
    h = Harness(build_scheduler(max_decode=2, max_seqs=8, max_prefill=8))
    for i in range(3):
        h.submit(f"r{i}", prompt(3, base=5 + i), max_tokens=30, ignore_eos=True)
    h.step()  # prefill all three
    served = [tuple(h.step()[0][1].request_ids) for _ in range(6)]
    assert all(len(s) == 2 for s in served)
    for rid in ("r0", "r1", "r2"):
        assert sum(rid in s for s in served) == 4


# ---------------------------------------------------------------------- finishing
def test_finish_on_stop_token_eos_length_and_context():
    p = prompt(6)
    free_run, _ = expected(p, 12, frozenset())
    stop_at = next(i for i, t in enumerate(free_run) if t != 1)
    h = Harness(build_scheduler(max_context=len(p) + 5, eos_token_ids=(free_run[0],)))
    h.submit("stop", p, max_tokens=12, ignore_eos=True, stop_token_ids=[free_run[stop_at]])
    h.submit("eos", p, max_tokens=12)
    h.submit("ctx", p, max_tokens=12, ignore_eos=True)
    h.submit("max", p, max_tokens=2, ignore_eos=True)
    h.run()
    assert h.outputs["stop"] == free_run[:free_run.index(free_run[stop_at]) + 1]
    assert h.outputs["eos"] == free_run[:1]  # the EOS token is part of the output
    assert h.outputs["ctx"] == free_run[:5] and h.outputs["max"] == free_run[:2]
    assert h.finish_reasons == {"stop": "stop", "eos": "stop", "ctx": "length", "max": "length"}


def test_outputs_match_the_dense_reference_for_many_requests():
    h = Harness(build_scheduler(chunk_size=5, max_batched_tokens=24, pool_blocks=200))
    prompts = {f"r{i}": prompt(3 + 5 * i, base=2 + i) for i in range(8)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_tokens=10)
    h.run()
    for rid, p in prompts.items():
        out, reason = expected(p, 10)
        assert h.outputs[rid] == out and h.finish_reasons[rid] == reason


# ---------------------------------------------------------------------- prefix cache
def test_prefix_hit_advances_computed_for_free_and_is_reported_once():
    h = Harness(build_scheduler(block_size=4))
    shared = prompt(12)
    h.submit("a", shared + [5], max_tokens=2, ignore_eos=True)
    h.run()
    h.submit("b", shared + [9, 9], max_tokens=2, ignore_eos=True)
    (_, plan), = h.schedule()
    assert int(plan.start_positions[0]) == 12 and int(plan.num_tokens[0]) == 2
    h.complete(0, plan)
    h.run()
    assert h.cached_tokens["b"] == 12 and h.cached_tokens["a"] == 0
    assert h.outputs["b"] == expected(shared + [9, 9], 2, frozenset())[0]
    stats = h.scheduler.stats()
    assert stats["prefix_cache_hits"] == 3 and stats["prefix_cache_hit_tokens"] == 12


def test_full_prompt_hit_still_computes_the_last_block():
    h = Harness(build_scheduler(block_size=4))
    p = prompt(8)  # exactly two blocks
    h.submit("a", p, max_tokens=1, ignore_eos=True)
    h.run()
    h.submit("b", p, max_tokens=1, ignore_eos=True)
    (_, plan), = h.schedule()
    assert int(plan.start_positions[0]) == 4 and int(plan.num_tokens[0]) == 4
    h.complete(0, plan)
    assert h.outputs["b"] == h.outputs["a"]


def test_concurrent_requests_share_blocks_as_soon_as_they_are_full():
    """b's prompt is a's prompt and a's first outputs: a computes block 1 by decoding, so b
    does not wait for it (only blocks inside a running prompt are waited for) and computes
    it too; whichever caches it second swaps its copy for the cached one."""
    h = Harness(build_scheduler(block_size=4, chunk_size=4))
    p = prompt(6)
    continued = expected(p, 6, frozenset())[0]
    h.submit("a", p, max_tokens=6, ignore_eos=True)
    h.step()  # a's first chunk: block 0, cached
    h.submit("b", p + continued[:3], max_tokens=4, ignore_eos=True)
    h.step()  # b: block 0 from the cache, computes block 1 and caches it; a the rest of its prompt
    h.step()
    h.step()  # a's second output fills its block 1: b's copy is cached
    a, b = h.scheduler.request("a"), h.scheduler.request("b")
    assert h.cached_tokens["b"] == 4
    assert a.block_ids[0] == b.block_ids[0]  # b started from a's cached block
    assert a.block_ids[1] == b.block_ids[1]  # a's duplicate of block 1 was swapped for b's
    assert h.scheduler.state.pool.ref_count(a.block_ids[1]) == 2
    h.run()
    assert h.outputs["a"] == continued
    assert h.outputs["b"] == expected(p + continued[:3], 4, frozenset())[0]


def test_requests_arriving_with_a_shared_prompt_compute_it_once():
    """Submitted together, b and c would each prefill the 12 tokens they share with a in the
    same step. They wait for a's blocks instead and hit them; d, whose first block differs,
    joins a's step. Greedy outputs are unchanged."""
    h = Harness(build_scheduler(block_size=4))
    shared = prompt(12)
    h.submit("a", shared + [5], max_tokens=3, ignore_eos=True)
    h.submit("b", shared + [9, 9], max_tokens=3, ignore_eos=True)
    h.submit("d", prompt(12, base=20) + [5], max_tokens=3, ignore_eos=True)
    h.submit("c", shared + [7], max_tokens=3, ignore_eos=True)
    (_, plan), = h.schedule()
    assert sorted(plan.request_ids) == ["a", "d"]
    h.complete(0, plan)
    (_, plan), = h.schedule()
    assert {"b", "c"} <= set(plan.request_ids)
    h.complete(0, plan)
    h.run()
    assert h.cached_tokens["b"] == 12 and h.cached_tokens["c"] == 12 and h.cached_tokens["d"] == 0
    for rid, p in (("a", shared + [5]), ("b", shared + [9, 9]), ("c", shared + [7])):
        assert h.outputs[rid] == expected(p, 3, frozenset())[0]


def test_a_waiting_request_follows_a_shared_prefill_chunk_by_chunk():
    """With chunks of one block, b waits while a computes each block b shares, then computes
    only its own last block; a different salt never waits."""
    h = Harness(build_scheduler(block_size=4, chunk_size=4))
    shared = prompt(12)
    h.submit("a", shared + [5], max_tokens=1, ignore_eos=True)
    h.submit("b", shared + [9], max_tokens=1, ignore_eos=True)
    h.submit("s", shared + [9], max_tokens=1, ignore_eos=True, cache_salt="other")
    steps = []
    while not steps or "b" not in steps[-1]:
        (_, plan), = h.schedule()
        steps.append(sorted(plan.request_ids))
        h.complete(0, plan)
    assert steps == [["a", "s"]] * 3 + [["a", "b", "s"]]  # a's blocks 0-2 land first
    h.run()
    assert h.cached_tokens["b"] == 12 and h.cached_tokens["s"] == 0


def test_an_aborted_prefill_no_longer_holds_back_a_waiting_request():
    h = Harness(build_scheduler(block_size=4, chunk_size=4))
    shared = prompt(12)
    h.submit("a", shared + [5], max_tokens=1, ignore_eos=True)
    h.submit("b", shared + [9], max_tokens=1, ignore_eos=True)
    (_, plan), = h.schedule()
    assert list(plan.request_ids) == ["a"]
    h.complete(0, plan)
    h.scheduler.abort_request("a")
    (_, plan), = h.schedule()
    assert list(plan.request_ids) == ["b"] and int(plan.start_positions[0]) == 4  # a's block 0
    h.complete(0, plan)
    h.run()
    assert h.outputs["b"] == expected(shared + [9], 1, frozenset())[0]


def test_salts_and_sampling_params():
    h = Harness(build_scheduler(block_size=4))
    p = prompt(9)
    h.submit("a", p, max_tokens=1, ignore_eos=True, cache_salt="lora-1")
    h.run()
    h.submit("b", p, max_tokens=1, ignore_eos=True, cache_salt="lora-2", top_k=5)
    h.submit("c", p, max_tokens=1, ignore_eos=True, cache_salt="lora-1", top_p=0.5)
    h.run()
    assert h.cached_tokens == {"a": 0, "b": 0, "c": 8}


def test_disabled_prefix_cache_frees_everything_on_finish():
    h = Harness(build_scheduler(enable_prefix_cache=False, pool_blocks=16))
    h.submit("a", prompt(9), max_tokens=3)
    h.run()
    stats = h.scheduler.stats()
    assert stats["kv_blocks_free"] == 16 and stats["prefix_cache_blocks"] == 0


def test_flush_frees_only_unreferenced_blocks():
    h = Harness(build_scheduler(pool_blocks=32, block_size=4))
    h.submit("a", prompt(12), max_tokens=1, ignore_eos=True)
    h.run()
    h.submit("b", prompt(8, base=30), max_tokens=50, ignore_eos=True)
    h.step()
    held = len(h.scheduler.request("b").block_ids)
    assert h.scheduler.flush_prefix_cache() == 3  # a's blocks; b's cached blocks stay
    assert h.scheduler.stats()["kv_blocks_free"] == 32 - held


# ---------------------------------------------------------------------- update / stats
def test_update_rejects_unknown_worker_and_step():
    h = Harness(build_scheduler())
    h.submit("a", prompt(3))
    (_, plan), = h.schedule()
    bad = StepResult(step_id=plan.step_id + 5, worker_id=0, request_ids=[],
                     num_sampled=np.zeros(0, np.int32), sampled_token_ids=np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="expected"):
        h.scheduler.update(bad)
    with pytest.raises(ValueError, match="unknown worker"):
        h.scheduler.update(StepResult(plan.step_id, 9, [], np.zeros(0, np.int32),
                                      np.zeros(0, np.int32)))


def test_worker_error_fails_the_step_requests():
    h = Harness(build_scheduler())
    h.submit("a", prompt(3))
    (_, plan), = h.schedule()
    deltas = h.scheduler.update(StepResult(plan.step_id, 0, [], np.zeros(0, np.int32),
                                           np.zeros(0, np.int32), error="CUDA OOM"))
    assert deltas.finish_reasons == ["error"] and deltas.errors == {"a": "CUDA OOM"}
    h.scheduler.check_invariants()
    assert h.scheduler.stats()["kv_blocks_in_use"] == 0


def test_logprobs_follow_emitted_tokens():
    h = Harness(build_scheduler())
    h.submit("a", prompt(3), max_tokens=2, ignore_eos=True, logprobs=1)
    h.step()
    (_, plan), = h.schedule()
    deltas = h.complete(0, plan)
    token = int(deltas.token_ids[0])
    assert deltas.logprobs.tolist() == [-(token % 7) - 0.5]
    assert deltas.top_logprob_ids.tolist() == [[token, token + 1]]


def test_stats_names_and_usage():
    h = Harness(build_scheduler(pool_blocks=20, block_size=4, num_workers=2))
    h.submit("a", prompt(10), max_tokens=5)
    h.schedule()
    stats = h.scheduler.stats()
    for name in ("num_requests_running", "num_requests_waiting", "kv_usage", "prefix_cache_hits",
                 "prefix_cache_misses", "prefix_cache_hit_ratio", "prefix_cache_blocks",
                 "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "num_preemptions",
                 "num_scheduled_tokens", "worker_1_num_requests_running", "pool_0_num_requests_waiting"):
        assert name in stats
    assert stats["kv_usage"] == pytest.approx(3 / 20) and stats["num_requests_running"] == 1
    assert stats["num_scheduled_tokens"] == 10
