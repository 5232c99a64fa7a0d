"""The `priority` field (vLLM's): it reaches the scheduler from HTTP (completions, chat) and
the ZMQ client, and a server that does not order by priority refuses a value other than 0."""
from __future__ import annotations

from justapi.client import make_submit
from tests.support.api_stack import run, serving_stack


def test_priority_reaches_the_scheduler_from_completions_and_chat():
    async def scenario() -> None:
        async with serving_stack(scheduling_policy="priority") as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "Hi", "max_tokens": 2, "priority": -3})
            assert response.status_code == 200
            response = await stack.http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "priority": 7})
            assert response.status_code == 200
            assert [r.priority for r in stack.fake.submitted] == [-3, 7]
    run(scenario)


def test_priority_without_the_priority_policy_is_a_400():
    async def scenario() -> None:
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/completions", json={
                "prompt": "Hi", "max_tokens": 2, "priority": 1})
            assert response.status_code == 400
            assert "scheduling-policy priority" in response.json()["error"]["message"]
            ok = await stack.http.post("/v1/completions", json={
                "prompt": "Hi", "max_tokens": 2, "priority": 0})
            assert ok.status_code == 200
            assert len(stack.fake.submitted) == 1
    run(scenario)


def test_the_zmq_client_sends_priority():
    submit = make_submit("Hi", None, None, {"priority": 5, "max_tokens": 3})
    assert submit.priority == 5 and submit.sampling.max_tokens == 3
