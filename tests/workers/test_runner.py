"""ModelRunner request state and step semantics, seeded reproducibility across batches and
recompute, and the KV pool (shared memory across processes, copy_blocks, CUDA errors)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from justapi.wire.protocol import PLACEHOLDER_TOKEN, NewRequest, StepPlan
from workers.engine import LLMEngine
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import TorchCpuBackend
from workers.model.backends import make_backend
from workers.model.forward import DecoderModel
from workers.runner import ModelRunner
from workers.sampler import Sampler, SamplingRow, apply_penalties
from workers.weights.gguf_loader import load_weights

BS = 4


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return DecoderModel(load_weights(GGUFFile(tiny_gguf(layers=2, type="Q8_0", context=64)), progress=False))


def make_runner(model: DecoderModel, pool: KVPool | None = None, seed: int = 0) -> ModelRunner:
    p = model.params
    pool = pool or KVPool.create(PoolShape(p.num_layers, 80, BS, p.num_kv_heads, p.head_dim))
    return ModelRunner(model, pool, TorchCpuBackend(BS), Sampler(seed))


def new(rid: str, tokens: list[int], params: SamplingParams, num_prompt: int | None = None) -> NewRequest:
    return NewRequest(rid, params, len(tokens) if num_prompt is None else num_prompt,
                      np.asarray(tokens, np.int32))


def blocks(first: int, count: int = 16) -> list[int]:
    return list(range(first, first + count))


GREEDY = SamplingParams(temperature=0.0)


# ------------------------------------------------------------------------------ request state


def test_state_learned_replaced_and_dropped(model):
    runner = make_runner(model)
    runner.execute(StepPlan.build(1, [("a", 0, [5, 6, 7], blocks(0), True)], [new("a", [5, 6, 7], GREEDY)]))
    assert runner.requests["a"].token_ids == [5, 6, 7] and runner.requests["a"].params == GREEDY
    hot = SamplingParams(temperature=0.5, seed=1)
    runner.execute(StepPlan.build(2, [("a", 0, [9, 9], blocks(0), True)], [new("a", [9, 9], hot)]))
    assert runner.requests["a"].token_ids == [9, 9] and runner.requests["a"].params == hot
    result = runner.execute(StepPlan.build(3, [], finished_request_ids=["a"]))
    assert "a" not in runner.requests and result.request_ids == []


def test_chunk_tokens_overwrite_history_for_rollback(model):
    runner = make_runner(model)
    runner.execute(StepPlan.build(1, [("a", 0, [1, 2, 3, 4, 5], blocks(0), True)], [new("a", [1, 2, 3, 4, 5], GREEDY)]))
    runner.execute(StepPlan.build(2, [("a", 5, [6, 7, 8], blocks(0), True)]))  # e.g. 2 drafts
    assert runner.requests["a"].token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    runner.execute(StepPlan.build(3, [("a", 6, [9], blocks(0), True)]))  # drafts 7, 8 rejected
    assert runner.requests["a"].token_ids == [1, 2, 3, 4, 5, 6, 9]


def test_mid_prefill_chunks_produce_nothing(model):
    runner = make_runner(model)
    prompt = list(range(10, 30))
    result = runner.execute(StepPlan.build(1, [("a", 0, prompt[:8], blocks(0), False),
                                               ("b", 0, [3, 4], blocks(16), True)],
                                           [new("a", prompt, GREEDY), new("b", [3, 4], GREEDY)]))
    assert result.request_ids == ["b"] and len(result.sampled_token_ids) == 1
    assert runner.requests["a"].token_ids == prompt[:8]  # truncated to the chunk, extended later
    result = runner.execute(StepPlan.build(2, [("a", 8, prompt[8:], blocks(0), True)]))
    assert result.request_ids == ["a"] and runner.requests["a"].token_ids == prompt


def test_chunked_prefill_samples_what_one_chunk_samples(model):
    prompt = list(range(40, 63))
    one = make_runner(model).execute(StepPlan.build(1, [("a", 0, prompt, blocks(0), True)],
                                                    [new("a", prompt, GREEDY)]))
    runner = make_runner(model)
    runner.execute(StepPlan.build(1, [("a", 0, prompt[:10], blocks(0), False)], [new("a", prompt, GREEDY)]))
    two = runner.execute(StepPlan.build(2, [("a", 10, prompt[10:], blocks(0), True)]))
    assert one.sampled_token_ids.tolist() == two.sampled_token_ids.tolist()


# ------------------------------------------------------------------------------ overlap


def test_a_placeholder_is_the_token_sampled_at_its_position(model):
    """A plan made before the last step's result names the token it sampled by a placeholder;
    resolved in the runner, the step is the one with the token written out, beside a chunk of
    another request."""
    prompt, other = [5, 6, 7], list(range(20, 29))
    first = StepPlan.build(1, [("a", 0, prompt, blocks(0), True)], [new("a", prompt, GREEDY)])
    runner, reference = make_runner(model), make_runner(model)
    token = int(runner.execute(first).sampled_token_ids[0])
    reference.execute(first)
    ahead = StepPlan.build(2, [("b", 0, other, blocks(16), True), ("a", 3, [PLACEHOLDER_TOKEN], blocks(0), True)],
                           [new("b", other, GREEDY)])
    spelled = StepPlan.build(2, [("b", 0, other, blocks(16), True), ("a", 3, [token], blocks(0), True)],
                             [new("b", other, GREEDY)])
    got, want = runner.execute(ahead), reference.execute(spelled)
    assert got.sampled_token_ids.tolist() == want.sampled_token_ids.tolist()
    assert runner.requests["a"].token_ids == prompt + [token]
    assert runner.requests["a"].last_sampled == (4, int(got.sampled_token_ids[1]))


@pytest.mark.parametrize("start", [4, 6])
def test_a_placeholder_without_its_sampled_token_is_refused(model, start):
    runner = make_runner(model)
    runner.execute(StepPlan.build(1, [("a", 0, [5, 6, 7, 8], blocks(0), False)],
                                  [new("a", [5, 6, 7, 8], GREEDY)]))  # nothing sampled yet
    if start == 6:  # sampled at position 5, not 6
        runner.execute(StepPlan.build(2, [("a", 4, [9], blocks(0), True)]))
    with pytest.raises(ValueError, match=f"no sampled token at position {start}"):
        runner.execute(StepPlan.build(3, [("a", start, [PLACEHOLDER_TOKEN], blocks(0), True)]))


def test_engine_outputs_are_the_same_with_overlap(tiny_gguf):
    """The real core planning ahead (placeholders, stops at N with N+1 computed) over the real
    runner: the same greedy tokens and finish reasons as one step at a time."""
    engine = LLMEngine(tiny_gguf(layers=2, type="Q8_0", context=64), block_size=4,
                       num_blocks=64, max_seqs=2, progress=False)
    prompts = [[3 + (i * 7 + j) % 90 for j in range(5 + 3 * i)] for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(3)]
    plain = engine.generate(prompts, params)
    stop = plain[2].token_ids[3]  # request 2 stops at its 4th token (or earlier: a repeat)
    params[2] = dataclasses.replace(params[2], stop_token_ids=[stop])
    plain = engine.generate(prompts, params)
    engine.limits = dataclasses.replace(engine.limits, overlap=True)
    ahead = engine.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in ahead] == \
        [(o.token_ids, o.finish_reason) for o in plain]
    assert plain[2].finish_reason == "stop" and plain[2].token_ids[-1] == stop
    assert engine.loop is not None and engine.loop.core.depth == 2
    engine.close()


def test_engine_outputs_are_the_same_with_multi_step_decoding(tiny_gguf):
    """The real core's multi-step plans over the real runner (each step's tokens the next
    one's input, a stop inside a plan, seeded sampling, logprobs asked): the same tokens and
    finish reasons as one step at a time."""
    engine = LLMEngine(tiny_gguf(layers=2, type="Q8_0", context=64), block_size=4,
                       num_blocks=64, max_seqs=3, progress=False)
    prompts = [[3 + (i * 7 + j) % 90 for j in range(5 + 3 * i)] for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=9 + 2 * i, ignore_eos=True, logprobs=2)
              for i in range(3)]
    params[1] = dataclasses.replace(params[1], temperature=0.8, seed=5)
    plain = engine.generate(prompts, params)
    stop = plain[2].token_ids[5]  # request 2 stops inside a plan (or earlier: a repeat)
    params[2] = dataclasses.replace(params[2], stop_token_ids=[stop])
    plain = engine.generate(prompts, params)
    engine.limits = dataclasses.replace(engine.limits, decode_steps=4)
    multi = engine.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in multi] == \
        [(o.token_ids, o.finish_reason) for o in plain]
    assert plain[2].finish_reason == "stop" and plain[2].token_ids[-1] == stop
    assert engine.loop is not None and engine.loop.stats()["num_multi_step_plans"] >= 2
    engine.close()


@pytest.mark.parametrize("plan,new_requests,needle", [
    ([("x", 0, [1], blocks(0), True)], [], "never announced"),
    ([("a", 5, [1], blocks(0), True)], [("a", [1, 2])], "starts at position 5"),
    ([("a", 62, [1, 2, 3], blocks(0), True)], [("a", [1] * 62)], "beyond the context length 64"),
    ([("a", 0, [1, 10**6], blocks(0), True)], [("a", [1, 2])], "token id 1000000 is outside"),
    ([("a", 0, [1, 2], blocks(0), True)], [("a", [1, -3])], "token id -3 is outside"),
    ([("a", 0, [1, 2], [80], True)], [("a", [1, 2])], r"block id 80 is outside the pool's \[0, 80\)"),
    ([("a", 0, [1, 2], [-1], True)], [("a", [1, 2])], "block id -1 is outside"),
    ([("a", 0, [1] * 9, [0, 1], True)], [("a", [1] * 9)], "of 2 blocks covers 8"),
    ([("a", 0, [1], blocks(0), True), ("a", 1, [1], blocks(0), True)], [("a", [1])], "twice"),
])
def test_bad_plans_raise_value_errors(model, plan, new_requests, needle):
    runner = make_runner(model)
    step = StepPlan.build(1, plan, [new(r, t, GREEDY) for r, t in new_requests])
    with pytest.raises(ValueError, match=needle):
        runner.execute(step)


def test_drafts_are_verified_against_their_logits(model):
    runner = make_runner(model)
    plan = StepPlan.build(1, [("a", 0, [1, 2, 3, 4], blocks(0), True)], [new("a", [1, 2, 3, 4], GREEDY)])
    plan = dataclasses.replace(plan, num_draft_tokens=np.array([2], np.int32))  # 3, 4: drafts
    logits = runner.forward_logits(plan)
    assert logits.shape == (3, model.params.vocab_size)
    greedy = logits.argmax(dim=-1).tolist()
    expected = [greedy[0]] if greedy[0] != 3 else [3, greedy[1]] if greedy[1] != 4 else [3, 4, greedy[2]]
    assert runner.execute(plan).sampled_token_ids.tolist() == expected


def test_runner_passes_prompt_and_output_history_to_penalties(tiny_gguf):
    """Penalized greedy tokens equal apply_penalties over (prompt, output) split as announced;
    the split matters (presence/frequency count output only), so a wrong split would show.
    The history holds every token of the vocabulary, so the argmax is always in it."""
    model = DecoderModel(load_weights(GGUFFile(tiny_gguf(layers=1, vocab=300, context=512)), progress=False))
    tokens = np.random.default_rng(0).permutation(300).tolist()
    chunk = [("a", 0, tokens, blocks(0, 75), True)]
    logits = make_runner(model).forward_logits(StepPlan.build(1, chunk, [new("a", tokens, GREEDY)]))
    answers = set()
    for num_prompt in (0, 100, 200, 300):
        params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
        got = make_runner(model).execute(StepPlan.build(1, chunk, [new("a", tokens, params, num_prompt)]))
        row = SamplingRow(params, np.asarray(tokens), num_prompt, len(tokens))
        want = int(apply_penalties(logits, [row]).argmax())
        assert got.sampled_token_ids.tolist() == [want]
        answers.add(want)
    assert len(answers) > 1


def test_step_result_carries_logprobs_when_asked(model):
    runner = make_runner(model)
    asks = SamplingParams(temperature=0.0, logprobs=2)
    result = runner.execute(StepPlan.build(1, [("a", 0, [4, 5, 6], blocks(0), True),
                                               ("b", 0, [7, 8], blocks(16), True)],
                                           [new("a", [4, 5, 6], asks), new("b", [7, 8], GREEDY)]))
    assert result.logprobs.shape == (2,) and result.top_logprob_ids.shape == (2, 2)
    assert result.top_logprob_ids[0, 0] == result.sampled_token_ids[0]  # greedy: the top token
    assert result.top_logprobs[0, 0] == pytest.approx(result.logprobs[0])
    assert result.top_logprob_ids[1].tolist() == [-1, -1]  # b did not ask
    plain = make_runner(model).execute(StepPlan.build(1, [("b", 0, [7, 8], blocks(16), True)],
                                                      [new("b", [7, 8], GREEDY)]))
    assert len(plain.logprobs) == 0


def _decode(runner: ModelRunner, rid: str, prompt: list[int], table: list[int], num: int,
            params: SamplingParams, others: list[tuple[str, list[int], list[int]]] = ()) -> list[int]:
    """Generate num tokens for rid, with `others` (greedy) batched alongside at every step."""
    out: list[int] = []
    state = {r: list(p) for r, p, _ in others}
    step_new = [new(rid, prompt, params)] + [new(r, p, GREEDY) for r, p, _ in others]
    for step in range(num):
        known = prompt + out
        start = 0 if step == 0 else len(known) - 1
        chunks = [(r, 0 if step == 0 else len(state[r]) - 1, state[r] if step == 0 else state[r][-1:], t, True)
                  for r, _, t in others]
        chunks.insert(len(chunks) // 2, (rid, start, known[start:], table, True))
        result = runner.execute(StepPlan.build(step, chunks, step_new if step == 0 else []))
        for r, token in zip(result.request_ids, result.sampled_token_ids.tolist()):
            (out.append(token) if r == rid else state[r].append(token))
    return out


def test_seeded_generation_is_independent_of_batch_and_recompute(model):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    prompt = [11, 12, 13, 14, 15]
    alone = _decode(make_runner(model, seed=1), "s", prompt, blocks(0), 10, params)
    others = [("o1", [3, 4, 5, 6, 7, 8, 9, 10, 11], blocks(20)), ("o2", [50], blocks(40))]
    batched = _decode(make_runner(model, seed=2), "s", prompt, blocks(0), 10, params, others)
    assert batched == alone
    # preempted after 6 tokens: relearned with prompt + output, recomputed from position 0
    runner = make_runner(model, seed=3)
    first = _decode(runner, "s", prompt, blocks(0), 6, params)
    rest = _decode(runner, "s", prompt + first, blocks(30), 4, params)
    assert first + rest == alone
    assert _decode(make_runner(model), "s", prompt, blocks(0), 10,
                   dataclasses.replace(params, seed=78)) != alone


# ------------------------------------------------------------------------------ KV pool


def test_shared_memory_pool_across_processes_and_no_leak(model):
    pool = KVPool.create(PoolShape(2, 8, BS, 2, 16), kind="shm")
    info = pool.info()
    assert info.kind == "shm" and os.path.exists(f"/dev/shm/{info.handle}")
    code = ("import sys, torch; from justapi.wire.protocol import PoolInfo; from workers.kv.pool import KVPool;"
            f"pool = KVPool.attach(PoolInfo(**{dataclasses.asdict(info)!r}));"
            "pool.tensor[1, 0, 3].fill_(float(pool.tensor[0, 1, 2].sum()) + 1.5); pool.close()")
    pool.tensor[0, 1, 2].fill_(0.25)  # 4 * 2 * 16 values
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert torch.all(pool.tensor[1, 0, 3] == 0.25 * 128 + 1.5)
    assert os.path.exists(f"/dev/shm/{info.handle}")  # the attacher's exit did not unlink it
    pool.close()
    assert not os.path.exists(f"/dev/shm/{info.handle}")
    with pytest.raises(ValueError, match="does not exist"):
        KVPool.attach(info)


def test_two_runners_share_one_pool(model):
    """A prefill on one worker, decode on another mapping the same pool: zero-copy hand-off."""
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, 64, BS, p.num_kv_heads, p.head_dim), kind="shm")
    try:
        prompt = list(range(20, 33))
        first = make_runner(model, pool).execute(StepPlan.build(1, [("a", 0, prompt, blocks(5), True)],
                                                                [new("a", prompt, GREEDY)]))
        token = int(first.sampled_token_ids[0])
        other = KVPool.attach(pool.info())
        decode = StepPlan.build(2, [("a", len(prompt), [token], blocks(5), True)],
                                [new("a", prompt + [token], GREEDY, num_prompt=len(prompt))])
        got = make_runner(model, other).forward_logits(decode)
        full = prompt + [token]
        want = make_runner(model).forward_logits(StepPlan.build(1, [("a", 0, full, blocks(0), True)],
                                                                [new("a", full, GREEDY)]))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        other.close()
    finally:
        pool.close()


def test_copy_blocks(model):
    src = KVPool.create(PoolShape(2, 6, BS, 2, 8))
    dst = KVPool.create(PoolShape(2, 9, BS, 2, 8))
    src.tensor.copy_(torch.randn(src.shape.dims))
    dst.copy_blocks(src, [4, 0], [1, 8])
    assert torch.equal(dst.tensor[:, :, 1], src.tensor[:, :, 4])
    assert torch.equal(dst.tensor[:, :, 8], src.tensor[:, :, 0])
    assert torch.all(dst.tensor[:, :, [0, 2, 3, 4, 5, 6, 7]] == 0)
    src.copy_blocks(src, [1], [2])  # within one pool
    assert torch.equal(src.tensor[:, :, 2], src.tensor[:, :, 1])
    with pytest.raises(ValueError, match="out of range"):
        dst.copy_blocks(src, [6], [0])
    with pytest.raises(ValueError, match="different layer/block shapes"):
        dst.copy_blocks(KVPool.create(PoolShape(2, 4, BS, 1, 8)), [0], [0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_fails_clearly(model):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        KVPool.create(PoolShape(2, 4, BS, 2, 8), kind="cuda_ipc", device="cuda")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        make_backend("cuda", BS)


def test_logit_rows_are_each_sampled_chunks_last_one_plus_drafts_rows():
    from workers.runner import logit_rows
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(0, 7))
        sizes = rng.integers(1, 6, n)
        chunks = [(f"r{i}", 0, list(range(int(s))), [0], bool(rng.integers(0, 2))) for i, s in enumerate(sizes)]
        plan = StepPlan.build(0, chunks)
        drafts = np.array([int(rng.integers(0, s)) for s in sizes], np.int32)
        plan = dataclasses.replace(plan, num_draft_tokens=drafts)
        ends = np.cumsum(sizes)
        want = [r for i in range(n) if chunks[i][4] for r in range(ends[i] - 1 - drafts[i], ends[i])]
        got = logit_rows(plan)
        assert got.dtype == np.int64 and got.tolist() == want
