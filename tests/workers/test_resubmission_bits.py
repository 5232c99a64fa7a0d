"""A request resubmitted after a scheduler restart (prompt + the tokens already delivered)
continues with the uninterrupted run's logprobs bit for bit, on the real runtime (default
`--weights auto`, the CPU kernels): its delivered tokens are recomputed in decode-sized chunks
(the rows the decode kernel computes alike in any batch), and with `--batch-invariant` its
prompt's rows too come out the same however the step's budget chunked it (every chunk on the
decode kernel, the weights on the int8 block kernels), beside a request that changes the
chunking between the two runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from justapi.sampling import SamplingParams
from justapi.wire.protocol import SubmitRequest, offsets
from workers.engine import LLMEngine
from workers.engine_loop import SchedulerLoop

MAX_TOKENS = 24


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], list[int]]]) -> dict[str, tuple[list[int], list[float]]]:
    """Each (id, prompt, delivered) to max_tokens, greedy: its new tokens and their logprobs."""
    loop = SchedulerLoop(engine.runner, engine.loop_limits())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    got: dict[str, tuple[list[int], list[float]]] = {}
    for rid, prompt, delivered in requests:
        loop.core.add_request(SubmitRequest(rid, np.asarray(prompt, np.int32), params,
                                            output_token_ids=np.asarray(delivered, np.int32)))
        got[rid] = ([], [])
    with torch.inference_mode():
        while loop.core.has_work():
            for _, plan in loop.core.schedule():
                deltas = loop.core.update(engine.runner.execute(plan))
                if deltas is None:
                    continue
                off = offsets(deltas.num_new_tokens)
                for i, rid in enumerate(deltas.request_ids):
                    got[rid][0].extend(deltas.token_ids[off[i]:off[i + 1]].tolist())
                    got[rid][1].extend(deltas.logprobs[off[i]:off[i + 1]].tolist())
    return got


@pytest.fixture(scope="module")
def model_path(tiny_gguf) -> str:
    return tiny_gguf(layers=2, hidden=128, heads=2, kv_heads=1, ffn=256, vocab=384, context=1024,
                     type="Q4_1")


def _engine(path: str, kv: str, invariant: bool) -> LLMEngine:
    return LLMEngine(path, weights="auto", kv_cache_dtype=kv, progress=False, max_seqs=8,
                     chunk_size=512, max_batched_tokens=512, batch_invariant=invariant)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 380, n).tolist()


@pytest.mark.parametrize("kv", ["float16", "float32"])
@pytest.mark.parametrize("prompt_len", [40, 300, 700])
def test_batch_invariant_resubmissions_continue_bit_for_bit(model_path, kv, prompt_len):
    """The prompt beside another of the same length: uninterrupted, the budget (512) gives the
    first request its whole prompt; resubmitted, it has more tokens than its neighbour and is
    admitted second, so its prompt is chunked otherwise. The logprobs still agree exactly."""
    engine = _engine(model_path, kv, invariant=True)
    prompt, other = _prompt(prompt_len, 1), _prompt(prompt_len, 2)
    ref_tokens, ref_logprobs = _run(engine, [("a", prompt, []), ("b", other, [])])["a"]
    assert len(ref_tokens) == MAX_TOKENS
    for k in (1, 9, 20):
        tokens, logprobs = _run(engine, [("a", prompt, ref_tokens[:k]), ("b", other, [])])["a"]
        assert tokens == ref_tokens[k:], k
        assert logprobs == ref_logprobs[k:], k  # bit for bit


@pytest.mark.parametrize("kv", ["float16", "float32"])
def test_by_default_delivered_tokens_are_recomputed_with_decodes_bits(model_path, kv):
    """Default mode, a request alone (its prompt chunked alike in both runs): the delivered
    tokens, 260 with the prompt (past the kernel's medium chunks: one chunk of them would be
    SDPA's sums), come back with decoding's bits."""
    engine = _engine(model_path, kv, invariant=False)
    prompt = _prompt(250, 3)
    ref_tokens, ref_logprobs = _run(engine, [("a", prompt, [])])["a"]
    for k in (10, 20):
        tokens, logprobs = _run(engine, [("a", prompt, ref_tokens[:k])])["a"]
        assert (tokens, logprobs) == (ref_tokens[k:], ref_logprobs[k:]), k
