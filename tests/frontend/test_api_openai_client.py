"""The official `openai` Python client against the app (ASGI transport): shapes it can parse."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.api_stack import MODEL, TEXTS, run, serving_stack, text_tokens, tokenizer


def _client(stack) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app))
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http,
                              max_retries=0)


def test_openai_client_completions_and_chat():
    async def scenario():
        async with serving_stack() as stack:
            client = _client(stack)
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            completion = await client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                                         logprobs=1, seed=3)
            assert completion.choices[0].text == tokenizer().decode(text_tokens(3)[:4])
            assert completion.choices[0].finish_reason == "length"
            assert len(completion.choices[0].logprobs.tokens) == 4
            assert completion.usage.completion_tokens == 4
            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=100, logprobs=True, top_logprobs=2,
                extra_body={"top_k": 5, "repetition_penalty": 1.1})
            assert chat.choices[0].message.content == TEXTS[0]
            assert chat.choices[0].message.role == "assistant"
            assert len(chat.choices[0].logprobs.content) == len(text_tokens(0)) + 1
            assert chat.usage.prompt_tokens_details.cached_tokens == 0
            sampling = stack.fake.submitted[-1].sampling
            assert (sampling.top_k, sampling.repetition_penalty) == (5, 1.1)
    run(scenario)


def test_openai_client_streams():
    async def scenario():
        async with serving_stack(tokens_per_step=2) as stack:
            client = _client(stack)
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True}, n=2, seed=7)
            texts = ["", ""]
            usage = None
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
                if chunk.usage is not None:
                    usage = chunk.usage
            seeds = [r.sampling.seed for r in stack.fake.submitted]
            assert texts == [TEXTS[s % 3] for s in seeds]
            assert usage.completion_tokens == sum(len(text_tokens(s)) + 1 for s in seeds)
            stream = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5,
                                                     stream=True, stop=["fox"])
            text = "".join([c.choices[0].text async for c in stream])
            assert text == tokenizer().decode(text_tokens(0)[:5])
    run(scenario)


def test_openai_client_raises_bad_request_with_the_message():
    async def scenario():
        async with serving_stack() as stack:
            client = _client(stack)
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model=MODEL, prompt="hi", temperature=-1)
            assert "temperature" in str(info.value)
            assert info.value.body["param"] == "temperature"
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="unknown", messages=[
                    {"role": "user", "content": "hi"}])
    run(scenario)
