"""/v1/chat/completions through the real app: the GGUF's chat template, streaming, logprobs."""
from __future__ import annotations

import pytest

from justapi.frontend.openai_models import ChatCompletionChunk, ChatCompletionResponse
from tests.support.api_fake_scheduler import fake_logprob
from tests.support.api_stack import (
    MODEL,
    TEXTS,
    chat_template,
    run,
    serving_stack,
    sse_events,
    text_tokens,
    tokenizer,
)

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                         {"type": "text", "text": "there"}]}]
PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]


def _rendered_ids(add_generation_prompt: bool = True) -> list[int]:
    text = chat_template().render(PLAIN, add_generation_prompt)
    return tokenizer().encode(text, add_special_tokens=False)


def test_chat_renders_the_template_and_answers_as_assistant():
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 100})
            assert response.status_code == 200, response.text
            data = ChatCompletionResponse.model_validate(response.json()).model_dump()
            assert data["object"] == "chat.completion"
            assert data["id"].startswith("chatcmpl-")
            choice = data["choices"][0]
            # no reasoning_content: the template does not think
            assert response.json()["choices"][0]["message"] == {"role": "assistant",
                                                                "content": TEXTS[0]}
            assert choice["finish_reason"] == "stop"
            assert choice["logprobs"] is None
            sent = stack.fake.submitted[0]
            assert sent.prompt_token_ids.tolist() == _rendered_ids()
            assert data["usage"]["prompt_tokens"] == len(_rendered_ids())
            assert data["usage"]["completion_tokens"] == len(text_tokens(0)) + 1
    run(scenario)


def test_chat_without_generation_prompt_and_default_max_tokens_fill_the_context():
    async def scenario():
        async with serving_stack(max_context=300) as stack:
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": PLAIN, "add_generation_prompt": False})
            assert response.status_code == 200, response.text
            sent = stack.fake.submitted[0]
            assert sent.prompt_token_ids.tolist() == _rendered_ids(False)
            assert sent.sampling.max_tokens == 300 - len(_rendered_ids(False))
    run(scenario)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_fields(field):
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": PLAIN, field: 4, "max_tokens": 4 if field == "max_tokens" else 99})
            data = response.json()
            assert data["choices"][0]["finish_reason"] == "length"
            assert data["usage"]["completion_tokens"] == 4
            assert stack.fake.submitted[0].sampling.max_tokens == 4
    run(scenario)


def test_chat_stream_role_first_then_content_then_done_and_usage():
    async def scenario():
        async with serving_stack(tokens_per_step=2) as stack:
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": PLAIN, "max_tokens": 100, "stream": True,
                "stream_options": {"include_usage": True}})
            events = sse_events(response.content)
            assert events[-1] == "[DONE]"
            usage_chunk, chunks = events[-2], events[:-2]
            for chunk in chunks:
                ChatCompletionChunk.model_validate(chunk)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert text == TEXTS[0]
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            assert usage_chunk["choices"] == []
            assert usage_chunk["usage"]["completion_tokens"] == len(text_tokens(0)) + 1
            assert len({c["id"] for c in events[:-1]}) == 1
    run(scenario)


def test_chat_logprobs_content_entries():
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": PLAIN, "max_tokens": 5, "logprobs": True, "top_logprobs": 3})
            data = ChatCompletionResponse.model_validate(response.json()).model_dump()
            content = data["choices"][0]["logprobs"]["content"]
            tokens = text_tokens(0)[:5]
            assert stack.fake.submitted[0].sampling.logprobs == 3
            assert [e["token"] for e in content] == [tokenizer().decode([t]) for t in tokens]
            assert [e["logprob"] for e in content] == pytest.approx(
                [fake_logprob(i) for i in range(5)])
            for entry in content:
                assert entry["bytes"] == list(entry["token"].encode("utf-8"))
                assert len(entry["top_logprobs"]) == 3
                assert entry["top_logprobs"][0]["token"] == entry["token"]
    run(scenario)


def test_chat_logprobs_without_top_and_streamed():
    async def scenario():
        async with serving_stack(tokens_per_step=2) as stack:
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": PLAIN, "max_tokens": 4, "logprobs": True, "stream": True})
            chunks = [e for e in sse_events(response.content) if e != "[DONE]"]
            assert stack.fake.submitted[0].sampling.logprobs == 0
            entries = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
            assert len(entries) == 4
            assert all(e["top_logprobs"] == [] for e in entries)
    run(scenario)


def test_chat_n_choices_and_stop_string():
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": PLAIN, "max_tokens": 100, "n": 2, "seed": 3, "stop": "fox"})
            data = response.json()
            assert len(data["choices"]) == 2
            texts = [c["message"]["content"] for c in data["choices"]]
            for text, request in zip(texts, stack.fake.submitted):
                full = TEXTS[request.sampling.seed % 3]
                assert text == (full[:full.index("fox")] if "fox" in full else full)
    run(scenario)
