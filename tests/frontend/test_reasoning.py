"""Reasoning in the frontend, without processes: the split of a reply into thinking and answer
is exact and the same however the text arrives, thinking tokens are counted up to the end
marker, the family is found from real chat templates, and the request's switches reach the
template (Qwen3's real one renders an empty thinking block when thinking is off)."""
from __future__ import annotations

import itertools

import pytest

from justapi.config.sections import REASONING_PARSERS
from justapi.frontend.errors import ApiError
from justapi.frontend.reasoning.formats import (
    DEEPSEEK_R1,
    PARSER_CHOICES,
    QWEN3,
    detect_reasoning_format,
    reasoning_format,
)
from justapi.frontend.reasoning.request import NO_REASONING, ReasoningSetup
from justapi.frontend.reasoning.splitter import ReasoningSplitter
from justapi.frontend.text.chat_template import ChatTemplate
from justapi.sampling import StructuredOutput
from tests.support.chat_templates import QWEN3 as QWEN3_TEMPLATE
from tests.support.chat_templates import REAL_TEMPLATES

# (reply text, starts inside thinking) -> (reasoning or None, content)
CASES = {
    ("<think>Let me see.</think>\n\nHello!", False): ("Let me see.", "\n\nHello!"),
    (" \n<think>\nx\n</think>y", False): ("\nx\n", "y"),
    ("Hello <think>not thinking</think>", False): (None, "Hello <think>not thinking</think>"),
    ("<thin", False): (None, "<thin"),
    ("", False): (None, ""),
    ("<think>cut off while thinking </thi", False): ("cut off while thinking </thi", ""),
    ("still thinking</think>answer <think>a</think>", True): (
        "still thinking", "answer <think>a</think>"),
    ("</think>", True): ("", ""),
    ("no end", True): ("no end", ""),
}
DEEPSEEK_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                     "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n"
                     "{% endif %}{# answers close </think> #}")


def _split(text: str, starts_thinking: bool, cuts: tuple[int, ...]) -> tuple[str | None, str]:
    splitter = ReasoningSplitter(QWEN3, starts_thinking=starts_thinking)
    reasoning, content = [], []
    bounds = [0, *cuts, len(text)]
    for begin, end in zip(bounds, bounds[1:]):
        delta = splitter.feed(text[begin:end])
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    tail = splitter.finish()
    reasoning.append(tail.reasoning)
    content.append(tail.content)
    return ("".join(reasoning) if splitter.has_reasoning else None), "".join(content)


@pytest.mark.parametrize(("text", "starts_thinking"), list(CASES))
def test_the_split_is_exact_however_the_text_arrives(text, starts_thinking):
    expected = CASES[(text, starts_thinking)]
    assert _split(text, starts_thinking, ()) == expected
    for size in (1, 2):  # every way to cut the text in two or three pieces
        for cuts in itertools.combinations(range(1, len(text)), size):
            assert _split(text, starts_thinking, cuts) == expected, cuts


def test_nothing_is_emitted_that_could_still_be_a_marker():
    splitter = ReasoningSplitter(QWEN3, starts_thinking=False)
    assert splitter.feed(" <thi").content == ""  # may open thinking
    assert splitter.feed("nk>abc</th").reasoning == "abc"  # may end it
    delta = splitter.feed("ink>Hi")
    assert (delta.reasoning, delta.content) == ("", "Hi")


def test_thinking_tokens_count_up_to_the_end_marker_token_even_when_its_text_comes_later():
    splitter = ReasoningSplitter(QWEN3, starts_thinking=False, end_token_id=99)
    splitter.feed("<think>ab", [98, 1, 2])
    splitter.feed("", [3, 99, 4])  # the marker's text held back (e.g. a stop string prefix)
    splitter.feed("</think>x", [5])
    assert splitter.reasoning_tokens == 5
    unclosed = ReasoningSplitter(QWEN3, starts_thinking=True, end_token_id=99)
    unclosed.feed("abc", [1, 2, 3])
    assert unclosed.reasoning_tokens == 3  # cut off while thinking: all of them
    answer_only = ReasoningSplitter(QWEN3, starts_thinking=False, end_token_id=99)
    answer_only.feed("Hello", [1, 2])
    assert answer_only.reasoning_tokens == 0


def test_thinking_tokens_without_a_marker_token_count_the_thinkings_text():
    pieces = ["  <thi", "nk>ab</th", "ink>", "answer </think>"]
    for starts_thinking, expected in ((False, "<think>ab</think>"), (True, "  <think>ab</think>")):
        streamed = ReasoningSplitter(QWEN3, starts_thinking=starts_thinking)
        for piece in pieces:
            streamed.feed(piece, [1])
        whole = ReasoningSplitter(QWEN3, starts_thinking=starts_thinking)
        whole.feed("".join(pieces), [1] * 4)
        assert streamed.reasoning_tokens == whole.reasoning_tokens == len(expected)
    cut = ReasoningSplitter(QWEN3, starts_thinking=True)
    cut.feed("abc</thi")
    cut.finish()
    assert cut.reasoning_tokens == len("abc</thi")


def test_the_family_comes_from_the_template():
    assert detect_reasoning_format(QWEN3_TEMPLATE) is QWEN3
    assert detect_reasoning_format(DEEPSEEK_TEMPLATE) is DEEPSEEK_R1
    for name, real in REAL_TEMPLATES.items():
        if name != "qwen3":
            assert detect_reasoning_format(real.source) is None, name
    assert reasoning_format("auto", QWEN3_TEMPLATE) is QWEN3
    assert reasoning_format("none", QWEN3_TEMPLATE) is None
    assert reasoning_format("deepseek_r1", "{{ messages }}") is DEEPSEEK_R1
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        reasoning_format("gpt-oss", QWEN3_TEMPLATE)
    assert REASONING_PARSERS == PARSER_CHOICES


def test_whether_a_reply_starts_inside_its_thinking_is_read_from_the_prompt():
    template = ChatTemplate(QWEN3_TEMPLATE, {"eos_token": "<|im_end|>"})
    messages = [{"role": "user", "content": "Hi"}]
    thinking = template.render(messages, True)
    off = template.render(messages, True, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and not thinking.endswith("</think>\n\n")
    assert not QWEN3.opens_in(thinking) and not QWEN3.opens_in(off)
    deepseek = ChatTemplate(DEEPSEEK_TEMPLATE).render(messages, True)
    assert DEEPSEEK_R1.opens_in(deepseek)


def test_reasoning_effort_and_template_kwargs_become_template_variables():
    setup = ReasoningSetup(QWEN3, has_thinking_switch=True)
    assert setup.template_variables(None, "none") == {"reasoning_effort": "none",
                                                      "enable_thinking": False}
    assert setup.template_variables(None, "high") == {"reasoning_effort": "high",
                                                      "enable_thinking": True}
    assert setup.template_variables({"enable_thinking": True}, "none")["enable_thinking"]
    assert NO_REASONING.template_variables(None, "low") == {"reasoning_effort": "low"}
    assert setup.template_variables(None, None) == {}
    for bad in ({"messages": []}, {"add_generation_prompt": False}, {"not a name": 1}):
        with pytest.raises(ApiError) as caught:
            setup.template_variables(bad, None)
        assert caught.value.param == "chat_template_kwargs"


def test_a_constraint_starts_after_thinking_named_by_token_where_the_marker_is_one():
    schema = StructuredOutput(kind="json_schema", spec='{"type": "object"}')
    by_text = ReasoningSetup(QWEN3)
    wrapped = by_text.after_thinking(schema, "<|im_start|>assistant\n")
    assert (wrapped.reasoning_start, wrapped.reasoning_end) == ("<think>", "</think>")
    assert by_text.after_thinking(schema, "<think>\n").reasoning_start == ""  # already open
    by_token = ReasoningSetup(QWEN3, start_token_id=7, end_token_id=8)
    wrapped = by_token.after_thinking(schema, "")
    assert (wrapped.reasoning_start, wrapped.reasoning_end) == ("<[7]>", "<[8]>")
    assert NO_REASONING.after_thinking(schema, "") is schema
    assert wrapped.key != schema.key  # compiled separately
