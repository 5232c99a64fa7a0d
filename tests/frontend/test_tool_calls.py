"""Tool calls in the frontend: each family's format parsed whole and streamed (any chunking
gives the same calls, each call whole in one delta), replies cut inside a call keeping their
complete calls, Llama 3 calling only at the reply's start, Mistral v11's name[ARGS]{...}, the
grammar accepting exactly what the parser reads (one call when parallel calls are off), the
format chosen from the template, and tools / past calls / tool results rendered through chat
templates."""
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
    MISTRAL_V11,
    MISTRAL_V11_IDS,
    ToolFormat,
    detect_tool_format,
)
from justapi.frontend.tools.grammar import ToolSpec, tool_call_lark
from justapi.frontend.tools.json_scan import MalformedJson, ObjectScanner
from justapi.frontend.tools.parser import ToolCallParser, new_call_id, parse_reply
from justapi.frontend.tools.render import chat_inputs
from justapi.frontend.tools.watch import ToolCallWatch
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


def _calls_for(tool_format: ToolFormat) -> list[tuple[str, ...]]:
    calls = CALLS if tool_format.is_parallel else CALLS[:1]
    if tool_format.id_marker:  # the model writes its own call ids
        return [(name, arguments, f"id{index}abcdef") for index, (name, arguments)
                in enumerate(calls)]
    return calls


def _prose(tool_format: ToolFormat) -> str:
    """Text a reply may have before its calls (none where calls open the reply)."""
    return "" if tool_format.is_start_only else "Let me check.\n"


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
        assert delta.index == len(streamed) and call["type"] == "function"  # whole, once
        streamed[delta.index] = {"id": call["id"], "type": "function",
                                 "function": dict(call["function"])}
    content = "".join(out.content for out in outputs)
    return content, [c.to_openai() for c in parser.calls], parser.is_malformed, list(
        streamed.values())


@pytest.mark.parametrize("tool_format", list(FORMATS.values()), ids=list(FORMATS))
def test_each_format_parses_whole_and_streamed(tool_format):
    text = _prose(tool_format) + tool_format.write_calls(_calls_for(tool_format))
    content, calls, is_malformed, streamed = _parse(tool_format, text)
    assert content == _prose(tool_format).strip() and not is_malformed
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [call[:2] for call in _calls_for(tool_format)]
    if tool_format.id_marker:
        assert [c["id"] for c in calls] == [call[2] for call in _calls_for(tool_format)]
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


def test_a_call_goes_out_whole_once_complete():
    parser = ToolCallParser(HERMES, new_id=lambda _: "c")
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert first.tool_calls == [] and first.content == ""
    second = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert [d.to_openai() for d in second.tool_calls] == [
        {"index": 0, "id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert parser.finish().content == ""


@pytest.mark.parametrize("tool_format", list(FORMATS.values()), ids=list(FORMATS))
def test_a_reply_cut_inside_a_call_keeps_its_complete_calls(tool_format):
    """max_tokens (or a repeated call) ends a reply mid-call: the complete calls stay calls,
    the unfinished one is dropped, and nothing of it is ever content, streamed or whole."""
    calls = _calls_for(tool_format)
    whole = _prose(tool_format) + tool_format.write_calls(calls)
    last = tool_format.write_call(*calls[-1])
    start = whole.rindex(last)
    for cut in (start + 8, start + len(last) // 2, start + len(last) - 1):
        text = whole[:cut]
        content, got, is_malformed, streamed = _parse(tool_format, text, [3] * len(text))
        assert not is_malformed and content == _prose(tool_format).strip()
        assert [c["function"]["name"] for c in got] == [c[0] for c in calls[:-1]]
        assert streamed == got
        whole_content, whole_calls = parse_reply(tool_format, text)  # the whole reply agrees
        assert whole_content == (content or None)
        assert [(c.name, c.arguments) for c in whole_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in got]


def test_key_order_and_string_arguments_are_tolerated():
    text = '{"tool_calls": [{"arguments": {"city": "Oslo"}, "name": "get_weather"}, ' \
           '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}, {"name": "get_time"}]}'
    _, calls, is_malformed, streamed = _parse(GENERIC, text, [2] * 200)
    assert not is_malformed and streamed == calls
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Oslo"}', '{"tz": "UTC"}',
                                                           "{}"]


@pytest.mark.parametrize("text", [
    'Sure {"tool_calls": oops',                                               # not the envelope
    'Sure {"tool_calls": [{"arguments": {}}]}',                               # no name
])
def test_a_broken_call_region_is_content(text):
    content, calls, is_malformed, _ = _parse(GENERIC, text, [4] * 30)
    assert is_malformed and calls == []
    assert content.replace(" ", "") == text.replace(" ", "")


def test_llama3_calls_only_at_the_start_of_the_reply():
    call = LLAMA3.write_calls([("get_weather", '{"city": "Rome"}')])
    assert call == '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    _, calls, _, streamed = _parse(LLAMA3, "\n " + call, [5] * 20)
    assert calls == streamed and calls[0]["function"]["arguments"] == '{"city": "Rome"}'
    for text in ("Call it like " + call, "{\"names\": 1} then " + call, call + " " + call):
        content, calls, is_malformed, _ = _parse(LLAMA3, text, [3] * 40)
        assert not is_malformed
        assert (content, len(calls)) == ((text, 0) if not text.startswith("{\"name\"")
                                         else (call, 1))


def test_mistral_v11_calls_are_name_args_pairs():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS] {}'
    content, calls, is_malformed, streamed = _parse(MISTRAL_V11, "Hi " + text, [2] * 60)
    assert (content, is_malformed, streamed) == ("Hi", False, calls)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert all(c["id"] == "id9" for c in calls)  # ids of 9 characters were asked for
    with_ids = '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}'
    assert _parse(MISTRAL_V11_IDS, with_ids)[1][0]["id"] == "a1b2c3d4e"
    for broken in ("[TOOL_CALLS]get time[ARGS]{}", "[TOOL_CALLS][ARGS]{}",
                   "[TOOL_CALLS]f[CALL]{}"):
        assert _parse(MISTRAL_V11, broken)[2]  # malformed: content


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
    v11 = "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}"
    assert detect_tool_format(v11) is MISTRAL_V11
    assert detect_tool_format(v11 + "{{ '[CALL_ID]' + tool_call.id }}") is MISTRAL_V11_IDS


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
    ids = ("abcdefghi", "123456789") if tool_format.id_marker else ("", "")
    calls = [("get_weather", '{"city": "Paris", "days": 3}', ids[0]), ("get_time", "{}", ids[1])]
    one = tool_format.write_calls(calls[:1])
    many = tool_format.write_calls(calls if tool_format.is_parallel else calls[:1])
    bad = tool_format.write_calls([("get_weather", '{"town": "Paris"}', ids[0])])
    prose = "Let me look. " if not tool_format.is_start_only else ""
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
    assert _accepts(vocabulary, auto, prose + many)
    assert not _accepts(vocabulary, auto, prose + bad)  # a started call is bound
    assert _parse(tool_format, prose + many)[1]  # and parses
    if tool_format.is_start_only:  # prose first: the rest is text, never a call
        assert _accepts(vocabulary, auto, "See: " + bad)
        assert _parse(tool_format, "See: " + bad)[1] == []


def test_grammar_names_special_token_markers(vocabulary):
    lark = tool_call_lark(MISTRAL, [CLOCK], is_required=False, is_parallel=True,
                          special_ids={"[TOOL_CALLS]": 1})
    assert "<[1]>" in lark
    matcher = llg.LLMatcher(vocabulary, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    call = tokenizer().encode('[{"name": "get_time", "arguments": {}}]', add_special_tokens=False)
    token_ids = tokenizer().encode("Hi", add_special_tokens=False) + [1] + call + [2]
    assert matcher.validate_tokens(token_ids) == len(token_ids)
    # Mistral v11: [TOOL_CALLS] (1) and [ARGS] (3) as tokens, the name as text, calls repeated
    lark = tool_call_lark(MISTRAL_V11, [CLOCK], is_required=True, is_parallel=True,
                          special_ids={"[TOOL_CALLS]": 1, "[ARGS]": 3})
    matcher = llg.LLMatcher(vocabulary, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    one = [1] + tokenizer().encode("get_time", add_special_tokens=False) + [3] + \
        tokenizer().encode("{}", add_special_tokens=False)
    assert matcher.validate_tokens(one + one + [2]) == 2 * len(one) + 1


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


# --------------------------------------------------------------------- the reply's watch

def test_the_watch_ends_a_reply_at_a_repeated_call_and_never_shows_it():
    first = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
    same = '{"name": "get_weather", "arguments": {"days": 2, "city": "Oslo"}}'  # keys reordered
    other = '{"name": "get_time", "arguments": {}}'
    text = '{"tool_calls": [' + ", ".join([first, other, same, other]) + "]}"
    for size in (1, 3, 7, len(text)):
        watch = ToolCallWatch(GENERIC, {}, None, is_required=True)
        shown, ended = "", False
        for at in range(0, len(text), size):
            piece, ended = watch.feed(text[at:at + size])
            shown += piece
            if ended:
                break
        assert ended and [c.name for c in watch.calls] == ["get_weather", "get_time"]
        assert shown == '{"tool_calls": [' + first + ", " + other  # the repeat never shows
        assert watch.feed("more") == ("", True)
    calm = ToolCallWatch(GENERIC, {}, None, is_required=True)
    shown, ended = calm.feed('{"tool_calls": [' + first + ", " + other + "]}")
    assert not ended and shown + calm.flush() == '{"tool_calls": [' + first + ", " + other + "]}"
