"""Constraints after a reasoning model's thinking, compiled against a real vocabulary: while
thinking every token of text (and the end marker's token) is allowed, so greedy output is the
unconstrained output; after the end marker the constraint holds, for every kind; thinking is
optional where the prompt did not open it; markers that are text work as well as tokens."""
from __future__ import annotations

import json

import llguidance as llg
import llguidance.numpy as llg_numpy
import numpy as np
import pytest

from justapi.frontend.text.tokenizer import Tokenizer
from justapi.frontend.tools.formats import HERMES
from justapi.frontend.tools.grammar import ToolSpec, tool_call_lark
from justapi.sampling import StructuredOutput
from justapi.structured.grammar import check_structured, grammar_text, parser_limits
from justapi.structured.tokenizer import from_tokenizer
from tests.support.api_stack import tokenizer as smollm_tokenizer
from tests.support.thinking_model import thinking_tokenizer

START, END = 49152, 49153  # the markers' ids in the thinking model's vocabulary
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                     "required": ["ok"], "additionalProperties": False})
TOOL_LARK = tool_call_lark(HERMES, [ToolSpec("greet", {"type": "object", "properties": {
    "who": {"type": "string"}}, "required": ["who"]})], is_required=True, is_parallel=False)
KINDS = {  # kind: (spec, an answer it accepts, one it refuses)
    "json_schema": (SCHEMA, '{"ok": true}', '{"ok": 1}'),
    "regex": ("[0-9]{2}", "42", "4a"),
    "choice": ('["yes", "no"]', "no", "maybe"),
    "gbnf": ('root ::= "a" [b-c]', "ac", "ad"),
    "lark": (TOOL_LARK, '<tool_call>\n{"name": "greet", "arguments": {"who": "you"}}\n</tool_call>',
             "Hello"),
}


class Vocabulary:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ll = from_tokenizer(tokenizer)

    def matcher(self, structured: StructuredOutput) -> llg.LLMatcher:
        check_structured(structured)
        matcher = llg.LLMatcher(self.ll, grammar_text(structured), limits=parser_limits())
        assert not matcher.get_error(), matcher.get_error()
        return matcher

    def allowed(self, matcher: llg.LLMatcher) -> np.ndarray:
        mask = llg_numpy.allocate_token_bitmask(1, self.ll.vocab_size)
        llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
        return np.unpackbits(mask.view(np.uint8), bitorder="little")[:self.ll.vocab_size]

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def feed(self, matcher: llg.LLMatcher, token_ids: list[int]) -> bool:
        """Consume the tokens while each is allowed; whether all were."""
        for token_id in token_ids:
            if not self.allowed(matcher)[token_id]:
                return False
            assert matcher.consume_token(token_id), matcher.get_error()
        return True


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary(thinking_tokenizer())


def _text_tokens(vocab: Vocabulary) -> np.ndarray:
    """Every token that is whole UTF-8 text (not special to the grammar engine, not a piece
    of a character)."""
    return np.array([not vocab.ll.is_special_token(i) and _is_utf8(vocab.ll.decode_bytes([i]))
                     for i in range(vocab.ll.vocab_size)])


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_holds_after_thinking_and_not_before(vocab, kind):
    spec, good, bad = KINDS[kind]
    structured = StructuredOutput(kind=kind, spec=spec, reasoning_end=f"<[{END}]>")
    matcher = vocab.matcher(structured)
    text_tokens = _text_tokens(vocab)
    for token_id in vocab.ids("I think { nope } 4a maybe </thi"):
        allowed = vocab.allowed(matcher)
        assert allowed[text_tokens].all() and allowed[END]  # thinking: anything but EOS
        assert not allowed[vocab.tokenizer.eos_token_id]
        assert matcher.consume_token(token_id)
    after = [END, *vocab.ids("\n\n")]
    assert vocab.feed(matcher, after + vocab.ids(good)) and matcher.is_accepting()
    refused = vocab.matcher(structured)
    assert vocab.feed(refused, vocab.ids("ok") + after)
    assert not (vocab.feed(refused, vocab.ids(bad)) and refused.is_accepting())


def test_thinking_is_optional_where_the_prompt_did_not_open_it(vocab):
    structured = StructuredOutput(kind="json_schema", spec=SCHEMA, reasoning_start=f"<[{START}]>",
                                  reasoning_end=f"<[{END}]>")
    direct = vocab.matcher(structured)
    assert vocab.allowed(direct)[START]
    assert vocab.feed(direct, vocab.ids('{"ok": false}')) and direct.is_accepting()
    thinking = vocab.matcher(structured)
    assert vocab.feed(thinking, [START, *vocab.ids("hmm"), END, *vocab.ids('{"ok": true}')])
    assert thinking.is_accepting()
    no_text_first = vocab.matcher(structured)
    assert not vocab.feed(no_text_first, vocab.ids("hmm"))


def test_markers_that_are_text_end_thinking_at_their_first_occurrence():
    vocab = Vocabulary(smollm_tokenizer())  # no <think> token: the markers are text
    structured = StructuredOutput(kind="regex", spec="[0-9]+", reasoning_start="<think>",
                                  reasoning_end="</think>")
    matcher = vocab.matcher(structured)
    assert vocab.feed(matcher, vocab.ids("<think>a </thin b</think>\n42"))
    assert matcher.is_accepting()
    after_end = vocab.matcher(structured)
    assert not vocab.feed(after_end, vocab.ids("<think>a</think> b"))


def test_a_bad_marker_is_refused():
    with pytest.raises(ValueError, match="reasoning_start needs reasoning_end"):
        StructuredOutput(kind="regex", spec="a", reasoning_start="<think>")
    with pytest.raises(ValueError, match="at most"):
        StructuredOutput(kind="regex", spec="a", reasoning_end="x" * 65)
