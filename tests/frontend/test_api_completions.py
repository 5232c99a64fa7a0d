"""/v1/completions through the real app, EngineClient and ZMQ, against a scripted scheduler."""
from __future__ import annotations

import pytest

from justapi.frontend.openai_models import CompletionResponse
from justapi.frontend.request_sampling import derive_seed
from justapi.wire.protocol import SubmitRequest
from tests.support.api_fake_scheduler import fake_logprob
from tests.support.api_stack import (
    MODEL,
    TEXTS,
    endless_script,
    eventually,
    run,
    serving_stack,
    sse_events,
    text_tokens,
    tokenizer,
)


async def _complete(stack, **body):
    response = await stack.http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return CompletionResponse.model_validate(response.json()).model_dump()


def test_completion_text_usage_and_tokens_sent():
    async def scenario():
        async with serving_stack() as stack:
            data = await _complete(stack, prompt="Say something", max_tokens=5)
            choice = data["choices"][0]
            assert choice["text"] == tokenizer().decode(text_tokens(0)[:5])
            assert choice["finish_reason"] == "length"
            prompt_ids = tokenizer().encode("Say something")
            assert data["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                                     "total_tokens": len(prompt_ids) + 5,
                                     "prompt_tokens_details": {"cached_tokens": 0},
                                     "completion_tokens_details": None}
            sent = stack.fake.submitted[0]
            assert sent.prompt_token_ids.tolist() == prompt_ids
            assert sent.sampling.max_tokens == 5
    run(scenario)


def test_eos_ends_with_stop_and_is_not_shown():
    async def scenario():
        async with serving_stack() as stack:
            data = await _complete(stack, prompt="x", max_tokens=100)
            assert data["choices"][0]["text"] == TEXTS[0]
            assert data["choices"][0]["finish_reason"] == "stop"
            assert data["usage"]["completion_tokens"] == len(text_tokens(0)) + 1  # EOS counts
    run(scenario)


def test_token_id_prompt_and_sampling_fields_reach_the_scheduler():
    async def scenario():
        async with serving_stack() as stack:
            await _complete(stack, prompt=[5, 6, 7], max_tokens=3, temperature=0.5, top_p=0.9,
                            top_k=7, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.2, seed=11, stop_token_ids=[9], ignore_eos=True,
                            user="someone", logit_bias={"12": -100, "3": 2.5})
            sent = stack.fake.submitted[0]
            assert sent.prompt_token_ids.tolist() == [5, 6, 7]
            s = sent.sampling
            assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, 7, 0.1)
            assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == \
                (0.5, -0.5, 1.2)
            assert (s.seed, s.stop_token_ids, s.ignore_eos, s.logprobs) == (11, (9,), True, None)
            assert s.logit_bias == ((3, 2.5), (12, -100.0))
    run(scenario)


def test_stream_chunks_join_to_the_full_text_and_end_with_done():
    async def scenario():
        async with serving_stack(tokens_per_step=2) as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 9, "stream": True})
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response.content)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
            assert "".join(c["choices"][0]["text"] for c in chunks) == \
                tokenizer().decode(text_tokens(0)[:9])
            assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    run(scenario)


def test_stream_include_usage_sends_a_last_usage_chunk():
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}})
            events = sse_events(response.content)
            assert events[-1] == "[DONE]"
            last = events[-2]
            assert last["choices"] == []
            assert last["usage"]["completion_tokens"] == 4
            assert last["usage"]["prompt_tokens"] == len(tokenizer().encode("hi"))
            assert all(e["usage"] is None for e in events[:-2])
    run(scenario)


@pytest.mark.parametrize("tokens_per_step", [1, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens_is_never_leaked_and_aborts(stream, tokens_per_step):
    stop = "quick br"  # " quick" and " brown" are separate tokens: the match spans two
    expected = TEXTS[0][:TEXTS[0].index(stop)]

    async def scenario():
        async with serving_stack(endless_script, max_context=4096,
                                 tokens_per_step=tokens_per_step) as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 2000, "stop": [stop, "never"], "stream": stream})
            if stream:
                events = sse_events(response.content)
                chunks = [e for e in events if e != "[DONE]"]
                pieces = [c["choices"][0]["text"] for c in chunks]
                assert all("br" not in p and "quick" not in p for p in pieces)
                text, finish = "".join(pieces), chunks[-1]["choices"][0]["finish_reason"]
            else:
                choice = response.json()["choices"][0]
                text, finish = choice["text"], choice["finish_reason"]
            assert text == expected
            assert finish == "stop"
            request_id = stack.fake.submitted[0].request_id
            assert await eventually(lambda: request_id in stack.fake.aborted)
    run(scenario)


def test_stop_string_usage_counts_tokens_up_to_the_match():
    async def scenario():
        async with serving_stack(tokens_per_step=4) as stack:
            data = await _complete(stack, prompt="hi", max_tokens=50, stop="brown")
            tokens = text_tokens(0)
            decoded = [tokenizer().decode(tokens[:k]) for k in range(len(tokens) + 1)]
            needed = next(k for k, text in enumerate(decoded) if "brown" in text)
            assert data["usage"]["completion_tokens"] == needed
    run(scenario)


def test_stop_token_id_is_counted_but_not_shown():
    async def scenario():
        async with serving_stack() as stack:
            tokens = text_tokens(0)
            data = await _complete(stack, prompt="hi", max_tokens=50, stop_token_ids=[tokens[3]])
            choice = data["choices"][0]
            assert choice["text"] == tokenizer().decode(tokens[:3])
            assert choice["finish_reason"] == "stop"
            assert data["usage"]["completion_tokens"] == 4
    run(scenario)


def test_n_with_seed_derives_distinct_deterministic_seeds():
    async def scenario():
        async with serving_stack() as stack:
            data = await _complete(stack, prompt="hi", max_tokens=60, n=3, seed=1234)
            seeds = [r.sampling.seed for r in stack.fake.submitted]
            assert seeds == [derive_seed(1234, i) for i in range(3)]
            assert seeds[0] == 1234 and len(set(seeds)) == 3
            by_index = {c["index"]: c["text"] for c in data["choices"]}
            assert by_index == {i: TEXTS[seeds[i] % 3] for i in range(3)}
            assert data["usage"]["completion_tokens"] == sum(
                len(text_tokens(s)) + 1 for s in seeds)
            assert data["usage"]["prompt_tokens"] == len(tokenizer().encode("hi"))
            await _complete(stack, prompt="hi", max_tokens=60, n=3, seed=1234)
            assert [r.sampling.seed for r in stack.fake.submitted[3:]] == seeds
    run(scenario)


def test_n_without_seed_and_batch_prompts_number_choices_prompt_major():
    async def scenario():
        async with serving_stack() as stack:
            data = await _complete(stack, prompt=["a", "b b"], max_tokens=2, n=2)
            assert sorted(c["index"] for c in data["choices"]) == [0, 1, 2, 3]
            assert all(r.sampling.seed is None for r in stack.fake.submitted)
            prompts = sorted(r.prompt_token_ids.tolist() for r in stack.fake.submitted)
            a, b = tokenizer().encode("a"), tokenizer().encode("b b")
            assert prompts == sorted([a, a, b, b])
            assert data["usage"]["prompt_tokens"] == len(tokenizer().encode("a")) + len(
                tokenizer().encode("b b"))
    run(scenario)


def test_n_streams_interleave_every_choice_to_its_finish():
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 6, "n": 3, "seed": 5, "stream": True})
            chunks = [e for e in sse_events(response.content) if e != "[DONE]"]
            texts = {i: "" for i in range(3)}
            finishes = {}
            for chunk in chunks:
                choice = chunk["choices"][0]
                texts[choice["index"]] += choice["text"]
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]
            seeds = [derive_seed(5, i) for i in range(3)]
            assert texts == {i: tokenizer().decode(text_tokens(seeds[i])[:6]) for i in range(3)}
            assert finishes == {0: "length", 1: "length", 2: "length"}
    run(scenario)


def test_logprobs_shape_values_and_offsets():
    async def scenario():
        async with serving_stack(tokens_per_step=2) as stack:
            data = await _complete(stack, prompt="hi", max_tokens=6, logprobs=2)
            choice = data["choices"][0]
            lp = choice["logprobs"]
            tokens = text_tokens(0)[:6]
            assert stack.fake.submitted[0].sampling.logprobs == 2
            assert lp["tokens"] == [tokenizer().decode([t]) for t in tokens]
            assert lp["token_logprobs"] == pytest.approx([fake_logprob(i) for i in range(6)])
            assert "".join(lp["tokens"]) == choice["text"]
            offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
            assert lp["text_offset"] == offsets
            for i, top in enumerate(lp["top_logprobs"]):
                assert len(top) == 2
                assert top[lp["tokens"][i]] == pytest.approx(fake_logprob(i))
    run(scenario)


def test_logprobs_in_stream_chunks_cover_every_token():
    async def scenario():
        async with serving_stack(tokens_per_step=3) as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 7, "logprobs": 0, "stream": True})
            chunks = [e for e in sse_events(response.content) if e != "[DONE]"]
            lps = [c["choices"][0]["logprobs"] for c in chunks]
            tokens = [t for lp in lps for t in lp["tokens"]]
            assert tokens == [tokenizer().decode([t]) for t in text_tokens(0)[:7]]
            assert [o for lp in lps for o in lp["text_offset"]] == \
                [sum(len(t) for t in tokens[:i]) for i in range(7)]
            assert all(len(top) == 1 for lp in lps for top in lp["top_logprobs"])
    run(scenario)


def test_echo_prefixes_the_prompt_text():
    async def scenario():
        async with serving_stack() as stack:
            data = await _complete(stack, prompt="Echo me:", max_tokens=3, echo=True)
            assert data["choices"][0]["text"] == "Echo me:" + tokenizer().decode(text_tokens(0)[:3])
            response = await stack.http.post("/v1/completions", json={
                "prompt": "Echo me:", "max_tokens": 3, "echo": True, "stream": True})
            chunks = [e for e in sse_events(response.content) if e != "[DONE]"]
            assert chunks[0]["choices"][0]["text"] == "Echo me:"
    run(scenario)


def test_repeated_prompt_reports_cached_tokens():
    prompt = " ".join(["word"] * 40)

    async def scenario():
        async with serving_stack() as stack:
            first = await _complete(stack, prompt=prompt, max_tokens=2)
            second = await _complete(stack, prompt=prompt, max_tokens=2)
            num_prompt = first["usage"]["prompt_tokens"]
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == \
                (num_prompt - 1) // 16 * 16 > 0
    run(scenario)


def test_many_concurrent_streams_all_complete():
    async def scenario():
        import asyncio
        async with serving_stack(endless_script, max_context=4096, tokens_per_step=2) as stack:
            async def one(i):
                response = await stack.http.post("/v1/completions", json={
                    "prompt": f"request {i}", "max_tokens": 40, "stream": True})
                chunks = [e for e in sse_events(response.content) if e != "[DONE]"]
                return "".join(c["choices"][0]["text"] for c in chunks)
            texts = await asyncio.gather(*(one(i) for i in range(16)))
            expected = tokenizer().decode((text_tokens(0) * 10)[:40])
            assert texts == [expected] * 16
            assert stack.engine.num_in_flight == 0
    run(scenario)


def test_submit_request_type_is_what_the_scheduler_gets():
    async def scenario():
        async with serving_stack() as stack:
            await _complete(stack, prompt="x", max_tokens=1)
            assert isinstance(stack.fake.submitted[0], SubmitRequest)
            assert stack.fake.submitted[0].prompt_token_ids.dtype.str == "<i4"
    run(scenario)


def test_multibyte_text_streams_whole_characters_only():
    async def scenario():
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 100, "seed": 2, "stream": True})
            chunks = [e for e in sse_events(response.content) if e != "[DONE]"]
            pieces = [c["choices"][0]["text"] for c in chunks]
            assert "".join(pieces) == TEXTS[2]
            assert all("\ufffd" not in piece for piece in pieces)
            assert all(piece for piece in pieces[:-1])  # held-back bytes send no empty events
            assert len(pieces) < len(text_tokens(2))  # some tokens were partial characters
    run(scenario)
