"""Tool calls in the frontend: each family's format parsed whole and streamed (any chunking
gives the same calls), the grammar accepting exactly what the parser reads, the format chosen
from the template, and tools / past calls / tool results rendered through chat templates."""
from __future__ import annotations

import json
import random

import llguidance as llg
import pytest

from justapi.frontend.text.chat_template import ChatTemplate
from justapi.frontend.tools.formats import (
    FORMATS,
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolFormat,
    detect_tool_format,
)
from justapi.frontend.tools.grammar import ToolSpec, tool_call_lark
from justapi.frontend.tools.json_scan import MalformedJson, ObjectScanner
from justapi.frontend.tools.parser import ToolCallParser, new_call_id
from justapi.frontend.tools.render import chat_inputs
from justapi.structured.tokenizer import from_tokenizer
from tests.support.api_stack import chat_template, tokenizer

WEATHER = ToolSpec("get_weather", {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "integer", "minimum": 1}},
    "required": ["city"], "additionalProperties": False})
CLOCK = ToolSpec("get_time", {"type": "object", "properties": {},
                              "additionalProperties": False})
ARGS = '{"city": "Z\\u00fcrich \\"}{", "days": [1, {"a": "]"}]}'  # braces inside strings
CALLS = [("get_weather", ARGS), ("get_time", "{}")]


def _calls_for(tool_format: ToolFormat) -> list[tuple[str, str]]:
    return CALLS if tool_format.is_parallel else CALLS[:1]


def _parse(tool_format: ToolFormat, text: str, chunk_sizes: list[int] | None = None):
    """(content, calls, is_malformed, streamed calls assembled from the deltas)."""
    parser = ToolCallParser(tool_format, new_id=lambda length: f"id{length}")
    pieces, at = [], 0
    for size in chunk_sizes or [len(text)]:
        pieces.append(text[at:at + size])
        at += size
    pieces.append(text[at:])
    outputs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    streamed: dict[int, dict] = {}
    for delta in (d for out in outputs for d in out.tool_calls):
        call = delta.to_openai()
        if "id" in call:
            assert delta.index == len(streamed) and call["type"] == "function"
            streamed[delta.index] = {"id": call["id"], "type": "function",
                                     "function": dict(call["function"])}
        else:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            streamed[delta.index]["function"]["arguments"] += call["function"]["arguments"]
    content = "".join(out.content for out in outputs)
    return content, [c.to_openai() for c in parser.calls], parser.is_malformed, list(
        streamed.values())


@pytest.mark.parametrize("tool_format", list(FORMATS.values()), ids=list(FORMATS))
def test_each_format_parses_whole_and_streamed(tool_format):
    text = "Let me check.\n" + tool_format.write_calls(_calls_for(tool_format))
    content, calls, is_malformed, streamed = _parse(tool_format, text)
    assert content == "Let me check." and not is_malformed
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        _calls_for(tool_format)
    assert json.loads(calls[0]["function"]["arguments"])["city"] == 'Zürich "}{'
    assert streamed == calls
    rng = random.Random(7)
    for _ in range(60):  # any split of the text streams the same calls and content
        sizes = [rng.randint(1, 6) for _ in range(len(text))]
        assert _parse(tool_format, text, sizes) == (content, calls, False, calls)


def test_calls_only_and_text_only_replies():
    content, calls, _, _ = _parse(GENERIC, GENERIC.write_calls(CALLS))
    assert content == "" and len(calls) == 2
    text = "No tools needed: the answer is {42} and <tool> [x]."
    for tool_format in FORMATS.values():
        assert _parse(tool_format, text, [3] * 30)[:3] == (text, [], False)


def test_arguments_stream_as_the_model_writes_them():
    parser = ToolCallParser(HERMES, new_id=lambda _: "c")
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [d.to_openai() for d in first.tool_calls] == [
        {"index": 0, "id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"ci'}}]
    second = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert [d.to_openai() for d in second.tool_calls] == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]
    assert parser.finish().content == ""


def test_key_order_and_string_arguments_are_tolerated():
    text = '{"tool_calls": [{"arguments": {"city": "Oslo"}, "name": "get_weather"}, ' \
           '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}, {"name": "get_time"}]}'
    _, calls, is_malformed, streamed = _parse(GENERIC, text, [2] * 200)
    assert not is_malformed and streamed == calls
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Oslo"}', '{"tz": "UTC"}',
                                                           "{}"]


@pytest.mark.parametrize("text", [
    'Sure {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Os',  # cut short
    'Sure {"tool_calls": oops',                                               # not the envelope
    'Sure {"tool_calls": [{"arguments": {}}]}',                               # no name
])
def test_a_broken_call_region_is_content(text):
    content, calls, is_malformed, _ = _parse(GENERIC, text, [4] * 30)
    assert is_malformed and calls == []
    assert content.replace(" ", "") == text.replace(" ", "")


def test_llama3_call_and_python_tag_free_text():
    text = LLAMA3.write_calls([("get_weather", '{"city": "Rome"}')])
    assert text == '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    _, calls, _, streamed = _parse(LLAMA3, text, [5] * 20)
    assert calls == streamed and calls[0]["function"]["arguments"] == '{"city": "Rome"}'


def test_mistral_ids_are_nine_characters():
    assert len(new_call_id(9)) == 9 and new_call_id(9).isalnum()
    assert new_call_id().startswith("call_") and len(new_call_id()) == 29
    parser = ToolCallParser(MISTRAL)
    parser.feed(MISTRAL.write_calls(CALLS))
    parser.finish()
    assert [len(call.id) for call in parser.calls] == [9, 9]


def test_object_scanner():
    scanner = ObjectScanner()
    assert scanner.feed('{"a": 1, "b" : [1, "]"], "c": "x\\"y"} tail') == 37
    assert scanner.is_done and scanner.values == {"a": "1", "b": '[1, "]"]', "c": '"x\\"y"'}
    with pytest.raises(MalformedJson):
        ObjectScanner().feed("[1]")


def test_format_from_template():
    assert detect_tool_format(chat_template().source) is GENERIC
    assert detect_tool_format(QWEN_LIKE) is HERMES
    assert detect_tool_format(LLAMA3_LIKE) is LLAMA3
    assert detect_tool_format("{{ '[TOOL_CALLS]' }}{{ tools }}") is MISTRAL


# --------------------------------------------------------------------- grammar

@pytest.fixture(scope="module")
def vocabulary() -> llg.LLTokenizer:
    return from_tokenizer(tokenizer())


def _accepts(vocabulary, lark: str, text: str) -> bool:
    """Whether the grammar accepts text then end-of-generation (SmolLM2's tokens)."""
    matcher = llg.LLMatcher(vocabulary, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    token_ids = tokenizer().encode(text, add_special_tokens=False) + [2]  # 2: <|im_end|>
    return matcher.validate_tokens(token_ids) == len(token_ids)


@pytest.mark.parametrize("tool_format", list(FORMATS.values()), ids=list(FORMATS))
def test_grammar_accepts_what_the_parser_reads(vocabulary, tool_format):
    calls = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]
    one = tool_format.write_calls(calls[:1])
    many = tool_format.write_calls(calls if tool_format.is_parallel else calls[:1])
    bad = tool_format.write_calls([("get_weather", '{"town": "Paris"}')])
    tools = [WEATHER, CLOCK]
    required = tool_call_lark(tool_format, tools, is_required=True, is_parallel=True)
    assert _accepts(vocabulary, required, one) and _accepts(vocabulary, required, many)
    assert not _accepts(vocabulary, required, bad)
    assert not _accepts(vocabulary, required, "Hello " + one)
    single = tool_call_lark(tool_format, tools, is_required=True, is_parallel=False)
    assert _accepts(vocabulary, single, one)
    assert _accepts(vocabulary, single, many) == (not tool_format.is_parallel)
    auto = tool_call_lark(tool_format, tools, is_required=False, is_parallel=True)
    assert _accepts(vocabulary, auto, "It is sunny, no call needed.")
    assert _accepts(vocabulary, auto, "Let me look. " + many)
    assert not _accepts(vocabulary, auto, "Let me look. " + bad)  # a started call is bound
    assert _parse(tool_format, "Let me look. " + many)[1]  # and parses


def test_grammar_names_a_special_token_trigger(vocabulary):
    lark = tool_call_lark(MISTRAL, [CLOCK], is_required=False, is_parallel=True,
                          trigger_token_id=1)
    assert "<[1]>" in lark
    matcher = llg.LLMatcher(vocabulary, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    call = tokenizer().encode('[{"name": "get_time", "arguments": {}}]', add_special_tokens=False)
    token_ids = tokenizer().encode("Hi", add_special_tokens=False) + [1] + call + [2]
    assert matcher.validate_tokens(token_ids) == len(token_ids)


# --------------------------------------------------------------------- rendering

QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nCall as <tool_call>\n{\"name\": ..., "
    "\"arguments\": ...}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>"
               "{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
               "{{ m.content }}<|eot_id|>{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER.parameters}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_native_template_gets_tools_and_argument_objects():
    messages, tools = chat_inputs(HISTORY, TOOLS, HERMES, describe_tools=True)
    assert tools == TOOLS
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = ChatTemplate(QWEN_LIKE).render(messages, True, tools)
    assert '"name": "get_weather", "description": "Weather now"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # a copy


def test_generic_template_gets_the_tools_in_the_system_message():
    messages, tools = chat_inputs(HISTORY, TOOLS, GENERIC, describe_tools=True)
    assert tools is None and messages[0]["role"] == "system"
    text = chat_template().render(messages, True, tools)
    assert text.startswith("<|im_start|>system\nYou can call the following tools:\n"
                           '[{"name": "get_weather", "description": "Weather now", ')
    assert '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}' in text
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    response = {"tool_response": {"tool": "get_weather", "tool_call_id": "call_1",
                                  "content": "18 C, sunny"}}
    assert f"<|im_start|>user\n{json.dumps(response)}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_generic_system_text_joins_an_existing_system_message():
    messages, _ = chat_inputs([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], TOOLS,
                              GENERIC, describe_tools=True)
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call the following tools:")
    plain, _ = chat_inputs(HISTORY[:1], TOOLS, GENERIC, describe_tools=False)
    assert plain == HISTORY[:1]  # tool_choice none: the prompt is untouched
