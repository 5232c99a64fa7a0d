"""A request whose text cannot be made fails alone (justapi/frontend/generation.py): the
detokenizer raising for one request's tokens ends that request with an OpenAI error (a 500
body, or an SSE error event and [DONE]), aborts its scheduler request (its blocks go), counts
justapi:request_failures_total{stage="detokenize"}, and the requests beside it keep their
text. The frontend stack of tests/support/api_stack.py (real app, real ZMQ, a scripted
scheduler)."""
from __future__ import annotations

import asyncio

import pytest

from justapi.frontend.text.detokenizer import IncrementalDetokenizer
from tests.support.api_stack import TEXTS, run, serving_stack, sse_events

POISON = "東"  # only TEXTS[2] (seed 2 mod 3) has it


@pytest.fixture
def poisoned_detokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    original = IncrementalDetokenizer.add

    def add(self: IncrementalDetokenizer, token_ids: list[int]) -> str:
        text = original(self, token_ids)
        if POISON in text:
            raise UnicodeError("injected: cannot show this text")
        return text
    monkeypatch.setattr(IncrementalDetokenizer, "add", add)


def _failures(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("justapi:request_failures_total{"):
            stage = line.split('stage="')[1].split('"')[0]
            out[stage] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.usefixtures("poisoned_detokenizer")
def test_a_request_whose_text_fails_ends_alone() -> None:
    async def scenario() -> None:
        # steps slow enough that a failed request is still running at the scheduler when its
        # text fails (at 1 ms a step, a loaded machine could see it finish first)
        async with serving_stack(step_s=0.05) as stack:
            def body(seed: int, stream: bool) -> dict:
                return {"prompt": "x", "max_tokens": 64, "seed": seed, "stream": stream}
            whole, streamed, bad_whole, bad_stream = await asyncio.gather(
                stack.http.post("/v1/completions", json=body(0, False)),
                stack.http.post("/v1/completions", json=body(1, True)),
                stack.http.post("/v1/completions", json=body(2, False)),
                stack.http.post("/v1/completions", json=body(5, True)))
            assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == TEXTS[0]
            events = sse_events(streamed.content)
            assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == TEXTS[1]
            assert bad_whole.status_code == 500
            error = bad_whole.json()["error"]
            assert error["type"] == "server_error"
            assert "detokenize failed: UnicodeError: injected" in error["message"]
            events = sse_events(bad_stream.content)
            assert events[-1] == "[DONE]"
            assert "detokenize failed: UnicodeError" in events[-2]["error"]["message"]
            # both failed requests' scheduler requests were aborted (their blocks go there)
            assert stack.fake.wait_for(lambda: len(stack.fake.aborted) == 2)
            metrics = (await stack.http.get("/metrics")).text
            assert _failures(metrics)["detokenize"] == 2
            again = await stack.http.post("/v1/completions", json=body(3, False))
            assert again.json()["choices"][0]["text"] == TEXTS[0]
    run(scenario)
