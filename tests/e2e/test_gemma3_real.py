"""gemma-3-270m, a real non-llama GGUF (architecture gemma3; Q4_K, Q5_0, Q6_K and Q8_0
tensors; the base model, whose file has no chat template), served by `justapi serve`: chats in
Gemma's turn format from the built-in template, `<end_of_turn>` ends an answer, and greedy
continuations agree with HF transformers on this GGUF (tokens recorded in
tests/support/gemma3.py) and, for a prompt longer than the 512-token sliding window, with our
dense reference forward (tests/support/reference_gemma3.py)."""
from __future__ import annotations

import signal

import httpx
import pytest

from justapi.client import Client
from justapi.ops.perplexity import DEFAULT_TEXT
from tests.support.gemma3 import HF_REFERENCES, MIN_MARGIN, gemma3_path
from tools.harness import ServedPool

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]

SERVE_ARGS = ("--max-context", "2048", "--max-seqs", "4")
LONG_PROMPT_TOKENS = 600  # past the 512-token window of its local layers; 2 prefill chunks
NUM_LONG_TOKENS = 6
LOGPROB_TOLERANCE = 0.3
"""Attending past the window instead moves these by 1.5-12 nats. The served default (auto)
rounds activations to 8 bits where its start-up plan (timed) picks that kernel: one of these
logprobs then read 0.157 off the fp32 reference, 0.1 passing only with the fp32-activation one."""
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
END_OF_TURN = 106


@pytest.fixture(scope="module")
def pool():
    served = ServedPool("--model", gemma3_path(), *SERVE_ARGS, zmq=True)
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []


@pytest.fixture(scope="module")
def client(pool):
    with Client(pool.zmq, timeout_s=600) as zmq_client:
        yield zmq_client


def greedy(client: Client, prompt, num_tokens: int, **options):
    return client.complete(prompt, max_tokens=num_tokens, temperature=0.0, ignore_eos=True,
                           **options)


def test_start_up_names_the_chat_template(pool) -> None:
    assert "using the built-in gemma template (architecture 'gemma3')" in pool.log()


@pytest.mark.parametrize("name", sorted(HF_REFERENCES))
def test_greedy_continuations_agree_with_hf(client, name: str) -> None:
    reference = HF_REFERENCES[name]
    out = greedy(client, list(reference.prompt_ids), len(reference.greedy))
    agreeing = reference.agreeing_prefix()
    assert agreeing >= 8
    assert out.token_ids[:agreeing] == list(reference.greedy[:agreeing])


def test_text_prompts_are_tokenized_as_hf_does(client) -> None:
    reference = HF_REFERENCES["fib"]
    out = greedy(client, reference.text, 4)
    assert out.num_prompt_tokens == len(reference.prompt_ids)
    assert out.token_ids == list(reference.greedy[:4])


def test_chat_is_rendered_in_gemma_turns(pool, client) -> None:
    reference = HF_REFERENCES["chat"]
    answer = httpx.post(f"{pool.base_url}/tokenize", json={"messages": QUESTION}, timeout=60)
    assert answer.json()["tokens"] == list(reference.prompt_ids)
    agreeing = reference.agreeing_prefix()
    out = client.complete(messages=QUESTION, max_tokens=agreeing, temperature=0.0,
                          ignore_eos=True)
    assert out.token_ids == list(reference.greedy[:agreeing])


def test_chat_completion_over_http(oai) -> None:
    model = oai.models.list().data[0].id
    reply = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=16,
                                        temperature=0)
    assert reply.usage.prompt_tokens == len(HF_REFERENCES["chat"].prompt_ids)
    assert reply.choices[0].message.content.strip()
    assert reply.choices[0].finish_reason in ("stop", "length")
    ended = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=16,
                                        temperature=0, logit_bias={str(END_OF_TURN): 100})
    assert ended.choices[0].finish_reason == "stop"  # <end_of_turn> ended it at once
    assert ended.usage.completion_tokens == 1 and ended.choices[0].message.content == ""


def test_past_the_sliding_window_agrees_with_the_reference(pool, client) -> None:
    """The served tokens, teacher-forced through the dense reference in one forward: each is
    the reference's argmax wherever that is not a near-tie, with the reference's logprob."""
    import torch

    from tests.support.reference_gemma3 import ReferenceGemma3

    text = DEFAULT_TEXT.read_text(encoding="utf-8")
    answer = httpx.post(f"{pool.base_url}/tokenize", json={"prompt": text}, timeout=60)
    prompt = answer.json()["tokens"][:LONG_PROMPT_TOKENS]
    assert len(prompt) == LONG_PROMPT_TOKENS
    out = greedy(client, prompt, NUM_LONG_TOKENS, logprobs=0)
    logits = ReferenceGemma3(gemma3_path()).forward(prompt + out.token_ids[:-1],
                                                    num_last=NUM_LONG_TOKENS)
    expected = torch.log_softmax(logits, -1)  # [NUM_LONG_TOKENS, vocab]
    top = torch.topk(logits, 2)
    is_clear = (top.values[:, 0] - top.values[:, 1]) >= MIN_MARGIN
    assert int(is_clear.sum()) >= NUM_LONG_TOKENS // 2
    for i, token in enumerate(out.token_ids):
        if is_clear[i]:
            assert token == int(top.indices[i, 0]), i
        assert abs(out.logprobs[i] - float(expected[i, token])) < LOGPROB_TOLERANCE, i
