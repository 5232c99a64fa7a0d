"""Reasoning end to end: `justapi serve` on a tiny Qwen3 made here that thinks (its vocabulary
has Qwen3's <think> tokens, its template is Qwen3's own, greedy decoding writes a fixed
thought and answer: tests/support/thinking_model.py), driven by the official openai and
anthropic clients. The split is exact on every endpoint, whole and streamed alike, with the
thinking's token count; a JSON Schema or a required tool call constrains only the answer (the
thinking is the unconstrained one, token for token) and the answer validates."""
from __future__ import annotations

import json
import signal

import httpx
import jsonschema
import pytest

from tests.support.thinking_model import ANSWER, THOUGHT, write_thinking_gguf
from tools.harness import ServedPool

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

MESSAGES = [{"role": "user", "content": "Hi!"}]
NUM_THINKING_TOKENS = 14  # <think>, 12 tokens of THOUGHT, </think>
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
GREET = {"type": "function", "function": {
    "name": "greet", "description": "Greet someone",
    "parameters": {"type": "object", "properties": {"who": {"enum": ["you", "me"]}},
                   "required": ["who"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    path = write_thinking_gguf(tmp_path_factory.mktemp("thinking") / "tiny-qwen3-thinking.gguf")
    served = ServedPool("--model", str(path), "--temperature", "0", "--pool-blocks", "256",
                        "--log-level", "warning")
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []


def test_chat_splits_the_thinking_exactly_whole_and_streamed(oai, model_id):
    whole = oai.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=40)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (
        THOUGHT, THOUGHT, ANSWER)
    assert whole.usage.completion_tokens_details.reasoning_tokens == NUM_THINKING_TOKENS
    assert whole.usage.completion_tokens == NUM_THINKING_TOKENS + 5  # 4 of ANSWER, EOS
    stream = oai.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=40,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    usage = chunks[-1].usage
    assert (usage.completion_tokens, usage.completion_tokens_details) == (
        whole.usage.completion_tokens, whole.usage.completion_tokens_details)


def test_a_schema_constrains_the_answer_not_the_thinking(oai, model_id):
    reply = oai.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}})
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert message.reasoning_content == THOUGHT  # greedy thinking: the unconstrained one
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_a_required_tool_call_follows_the_thinking(oai, model_id):
    reply = oai.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=60,
                                        tools=[GREET], tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == THOUGHT
    [call] = choice.message.tool_calls
    assert call.function.name == "greet"
    jsonschema.validate(json.loads(call.function.arguments), GREET["function"]["parameters"])


def test_responses_return_a_reasoning_item_whole_and_streamed(oai, model_id):
    whole = oai.responses.create(model=model_id, input="Hi!", max_output_tokens=40)
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT
    assert whole.output_text == ANSWER
    assert whole.usage.output_tokens_details.reasoning_tokens == NUM_THINKING_TOKENS
    with oai.responses.stream(model=model_id, input="Hi!", max_output_tokens=40) as stream:
        thinking = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert thinking == THOUGHT
    assert final.output_text == ANSWER and final.usage.output_tokens == whole.usage.output_tokens
    effort_off = oai.responses.create(model=model_id, input="Hi!", max_output_tokens=40,
                                      reasoning={"effort": "none"})
    assert effort_off.usage.input_tokens == whole.usage.input_tokens + 4  # the empty block


def test_messages_return_a_thinking_block_whole_and_streamed(claude, model_id):
    whole = claude.messages.create(model=model_id, max_tokens=40, messages=MESSAGES)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in whole.content] == [("thinking", THOUGHT), ("text", ANSWER)]
    assert whole.stop_reason == "end_turn"
    assert whole.usage.output_tokens_details.thinking_tokens == NUM_THINKING_TOKENS
    with claude.messages.stream(model=model_id, max_tokens=40, messages=MESSAGES) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == \
        [b.model_dump(exclude_none=True) for b in whole.content]
    counted = claude.messages.count_tokens(model=model_id, messages=MESSAGES,
                                           thinking={"type": "disabled"})
    assert counted.input_tokens == whole.usage.input_tokens + 4  # Qwen3's empty thinking block


def test_thinking_switched_off_reaches_the_template(pool):
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    tokens = httpx.post(f"{pool.base_url}/tokenize", json={**body, "return_token_strs": True})
    assert "".join(tokens.json()["token_strs"]).endswith("<think>ĊĊ</think>ĊĊ")
