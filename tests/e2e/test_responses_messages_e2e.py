"""/v1/responses and /v1/messages end to end: `justapi serve` on SmolLM2 (greedy), driven by the
official openai and anthropic clients. Each endpoint is a translation into the chat path, so
its answer equals chat's for the same conversation (tool calls and their results included);
whole and streamed replies agree; schema-constrained answers validate; a stop sequence, a cut
reply and a bad request come back in each API's own terms."""
from __future__ import annotations

import json
import signal
from typing import Literal

import anthropic
import jsonschema
import openai
import pydantic
import pytest

from tools.harness import ServedPool

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
WEATHER = {"name": "get_weather", "description": "The weather now in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
               "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": WEATHER}
ANSWER_SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Berlin", "Rome"]}, "sure": {"type": "boolean"}},
    "required": ["city", "sure"], "additionalProperties": False}
MAX_TOKENS = 16


class CityAnswer(pydantic.BaseModel):
    city: Literal["Paris", "Berlin", "Rome"]
    sure: bool


@pytest.fixture(scope="module")
def pool():
    served = ServedPool("--temperature", "0", "--pool-blocks", "512", "--log-level", "warning")
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert served.leftovers() == []


def _chat(oai, model_id, messages, **extra):
    return oai.chat.completions.create(model=model_id, messages=messages,
                                       max_tokens=MAX_TOKENS, **extra)


def test_responses_answer_as_chat_does_whole_and_streamed(oai, model_id):
    chat = _chat(oai, model_id, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": QUESTION}])
    whole = oai.responses.create(model=model_id, instructions=SYSTEM, input=QUESTION,
                                 max_output_tokens=MAX_TOKENS)
    assert whole.status == "completed" and [item.type for item in whole.output] == ["message"]
    assert whole.output_text == chat.choices[0].message.content.lstrip()
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with oai.responses.stream(model=model_id, instructions=SYSTEM, input=QUESTION,
                              max_output_tokens=MAX_TOKENS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    cut = oai.responses.create(model=model_id, input=QUESTION, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_responses_function_calls_and_their_outputs_round_trip(oai, model_id):
    tool = {"type": "function", **WEATHER}
    first = oai.responses.create(model=model_id, input="What is the weather in Paris?",
                                 tools=[tool], tool_choice="required", max_output_tokens=60)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = "18 degrees and sunny"
    follow_up = oai.responses.create(
        model=model_id, tools=[tool], max_output_tokens=MAX_TOKENS,
        input=[{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(
            exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                 "output": result}])
    chat = _chat(oai, model_id, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}], tools=[CHAT_TOOL])
    chat_message = chat.choices[0].message
    assert follow_up.output_text == (chat_message.content or "").lstrip()
    assert follow_up.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_text_format_json_schema_validates(oai, model_id):
    parsed = oai.responses.parse(model=model_id, input=QUESTION, text_format=CityAnswer,
                                 max_output_tokens=40)
    assert isinstance(parsed.output_parsed, CityAnswer)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model=model_id, input=QUESTION, previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as renamed:
        oai.responses.create(model=model_id, input=QUESTION, max_output_tokens=100_000)
    assert renamed.value.body["param"] == "max_output_tokens"


def test_messages_answer_as_chat_does_whole_and_streamed(claude, oai, model_id):
    chat = _chat(oai, model_id, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": QUESTION}], tools=[CHAT_TOOL],
                 tool_choice="none")
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"],
              "input_schema": WEATHER["parameters"]}]
    whole = claude.messages.create(model=model_id, max_tokens=MAX_TOKENS, system=SYSTEM,
                                   messages=messages, tools=tools, tool_choice={"type": "none"})
    [text] = whole.content
    assert text.type == "text" and text.text == chat.choices[0].message.content.lstrip()
    assert whole.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length"
                                 else "end_turn")
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with claude.messages.stream(model=model_id, max_tokens=MAX_TOKENS, system=SYSTEM,
                                messages=messages, tools=tools,
                                tool_choice={"type": "none"}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text.text and final.content[0].text == text.text
    assert final.stop_reason == whole.stop_reason
    counted = claude.messages.count_tokens(model=model_id, system=SYSTEM, messages=messages,
                                           tools=tools, tool_choice={"type": "none"})
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_messages_tool_use_and_tool_result_round_trip(claude, oai, model_id):
    tools = [{"name": WEATHER["name"], "input_schema": WEATHER["parameters"],
              "description": WEATHER["description"]}]
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    first = claude.messages.create(model=model_id, max_tokens=60, messages=[ask], tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["parameters"])
    follow_up = claude.messages.create(model=model_id, max_tokens=MAX_TOKENS, tools=tools, messages=[
        ask, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 degrees and sunny"}]}])
    chat = _chat(oai, model_id, [ask, {"role": "assistant", "content": "", "tool_calls": [{
        "id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 degrees and sunny"}],
        tools=[CHAT_TOOL])
    assert "".join(b.text for b in follow_up.content if b.type == "text") == \
        (chat.choices[0].message.content or "").lstrip()


def test_messages_stop_sequences_output_format_and_errors(claude, model_id):
    ask = [{"role": "user", "content": QUESTION}]
    plain = claude.messages.create(model=model_id, max_tokens=MAX_TOKENS, messages=ask)
    word = plain.content[0].text.split()[2]
    stopped = claude.messages.create(model=model_id, max_tokens=MAX_TOKENS, messages=ask,
                                     stop_sequences=[word])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert plain.content[0].text.startswith(stopped.content[0].text)
    shaped = claude.messages.create(model=model_id, max_tokens=40, messages=ask, output_config={
        "format": {"type": "json_schema", "schema": ANSWER_SCHEMA}})
    jsonschema.validate(json.loads(shaped.content[0].text), ANSWER_SCHEMA)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=model_id, max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                      "url": "x"}}]}])
    assert refused.value.body["type"] == "error"
    assert "only text" in refused.value.body["error"]["message"]
