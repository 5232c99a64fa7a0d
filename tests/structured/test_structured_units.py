"""justapi/structured on its own: grammar text and its check (unsupported features named),
the compile cache, one request's matcher (drafts, forced tokens, state across a preemption),
and a step's bitmask rows (drafts and trees equal one-at-a-time masks)."""
from __future__ import annotations

import json
import subprocess
import sys

import llguidance as llg
import llguidance.numpy as lnp
import numpy as np
import pytest

from justapi.sampling import SamplingParams, StructuredOutput
from justapi.structured import check_structured, grammar_text
from justapi.structured.compiler import GrammarCompiler
from justapi.structured.masks import PARALLEL_MIN_ROWS, MaskItem, fill_masks
from justapi.structured.matcher import RequestGrammar
from justapi.structured.tokenizer import mask_words
from justapi.wire.codec import decode, encode
from tests.support.structured import SIM_EOS, sim_token_list

TOKENS = sim_token_list()


def _ids(text: str) -> list[int]:
    return TOKENS(text.encode())


def _grammar(structured: StructuredOutput) -> RequestGrammar:
    compiler = GrammarCompiler(TOKENS.ll_tokenizer)
    grammar = RequestGrammar(compiler.submit(structured))
    grammar.future.result(timeout=30)
    assert grammar.start() == ""
    return grammar


def _accepts(structured: StructuredOutput, text: str) -> bool:
    grammar = _grammar(structured)
    ids = _ids(text)
    return grammar.num_valid_drafts(ids, [], {SIM_EOS}) == len(ids) and all(
        grammar.consume(t) for t in ids) and grammar.live.is_accepting()


# ---------------------------------------------------------------------- specs and checks
def test_structured_output_travels_in_sampling_params() -> None:
    params = SamplingParams(structured=StructuredOutput("regex", "[0-9]+", "compact"))
    assert decode(encode(params)) == params
    assert SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(ValueError, match="json_object constraint takes no spec"):
        StructuredOutput("json_object", "{}")
    with pytest.raises(ValueError, match="needs a spec"):
        StructuredOutput("regex")
    with pytest.raises(ValueError, match="whitespace must be one of"):
        StructuredOutput("json_object", whitespace="loose")


@pytest.mark.parametrize("structured, text, ok", [
    (StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})), '{"a": 12}', True),
    (StructuredOutput("json_schema", '{"type": "integer"}'), '"x"', False),
    (StructuredOutput("json_schema", '{"type": "array"}', "compact"), '[1,2]', True),
    (StructuredOutput("json_schema", '{"type": "array"}', "compact"), '[1, 2]', False),
    (StructuredOutput("json_schema", '{"type": "array"}', "flexible"), '[\n  1, 2]', True),
    (StructuredOutput("json_object"), '{"k": [true, null]}', True),
    (StructuredOutput("json_object"), '[1]', False),
    (StructuredOutput("regex", "[0-9]{3}-[a-z]+"), "123-ab", True),
    (StructuredOutput("regex", "[0-9]{3}-[a-z]+"), "12-ab", False),
    (StructuredOutput("choice", '["yes", "no"]'), "no", True),
    (StructuredOutput("choice", '["yes", "no"]'), "maybe", False),
    (StructuredOutput("gbnf", 'root ::= "id" [0-9]{2}'), "id42", True),
    (StructuredOutput("gbnf", 'root ::= "id" [0-9]{2}'), "id4x", False),
    (StructuredOutput("lark", 'start: "ok" | NUM\nNUM: /[0-9]+/'), "907", True),
])
def test_grammars_accept_exactly_their_language(structured: StructuredOutput, text: str,
                                               ok: bool) -> None:
    check_structured(structured)
    assert _accepts(structured, text) is ok


@pytest.mark.parametrize("structured, feature", [
    (StructuredOutput("json_schema", '{"not": {"type": "string"}}'), 'Unimplemented keys: ["not"]'),
    (StructuredOutput("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (StructuredOutput("json_schema", '{"if": {}, "then": {}}'), '"if"'),
    (StructuredOutput("json_schema", '{"type": "string", "format": "bogus"}'), "Unknown format"),
    (StructuredOutput("json_schema", json.dumps({"oneOf": [{"type": "number"},
                                                           {"type": "integer"}]})), "oneOf"),
    (StructuredOutput("json_schema", '{"type": '), "the schema is not JSON"),
    (StructuredOutput("regex", "(?=x)y"), "look-around"),
    (StructuredOutput("regex", "a(b"), "unclosed group"),
    (StructuredOutput("lark", "start: foo"), 'unknown name: "foo"'),
    (StructuredOutput("gbnf", 'root ::= "a" | ('), "Failed to convert the grammar from GBNF"),
    (StructuredOutput("choice", '["a", 3]'), "JSON list of 1 to"),
    (StructuredOutput("choice", "yes"), "must be a JSON list"),
])
def test_check_names_the_unsupported_feature(structured: StructuredOutput, feature: str) -> None:
    with pytest.raises(ValueError, match=f"^{structured.kind}: ") as info:
        check_structured(structured)
    assert feature in str(info.value) and len(str(info.value)) < 600
    assert "<state>" not in str(info.value)


def test_disjoint_one_of_is_supported_and_x_guidance_can_coerce() -> None:
    check_structured(StructuredOutput("json_schema", json.dumps(
        {"oneOf": [{"type": "integer"}, {"type": "string"}]})))
    check_structured(StructuredOutput("json_schema", json.dumps(
        {"oneOf": [{"type": "number"}, {"type": "integer"}],
         "x-guidance": {"coerce_one_of": True}})))


# ---------------------------------------------------------------------- compiler
def test_compile_cache_hits_and_failed_compiles() -> None:
    compiler = GrammarCompiler(TOKENS.ll_tokenizer)
    regex = StructuredOutput("regex", "[a-z]+")
    first = compiler.submit(regex)
    assert compiler.submit(StructuredOutput("regex", "[a-z]+")) is first
    assert compiler.submit(StructuredOutput("regex", "[a-z]+", "compact")) is not first
    bad = compiler.submit(StructuredOutput("json_schema", '{"not": {}}'))
    assert bad.result(timeout=30).prototype is None and "not" in bad.result().error
    assert first.result(timeout=30).prototype is not None
    stats = compiler.stats()
    assert (stats["structured_cache_hits"], stats["structured_cache_misses"]) == (1, 3)
    compiler.close()


def test_compile_cache_is_bounded() -> None:
    compiler = GrammarCompiler(TOKENS.ll_tokenizer, cache_size=2)
    for i in range(4):
        compiler.submit(StructuredOutput("regex", f"a{{{i + 1}}}")).result(timeout=30)
    compiler.submit(StructuredOutput("regex", "a{5}"))
    assert len(compiler._cache) <= 3  # the newest may still compile
    compiler.close()


def test_each_request_gets_its_own_matcher() -> None:
    compiler = GrammarCompiler(TOKENS.ll_tokenizer)
    choice = StructuredOutput("choice", '["ab", "ba"]')
    one, two = RequestGrammar(compiler.submit(choice)), RequestGrammar(compiler.submit(choice))
    one.future.result(timeout=30)
    assert one.start() == "" and two.start() == ""
    assert one.consume(_ids("a")[0])
    assert two.forced_tokens(8) == []  # still at the start: a or b
    assert one.forced_tokens(8) == _ids("b")


# ---------------------------------------------------------------------- matcher
def test_drafts_are_cut_at_the_first_invalid_token_without_changing_state() -> None:
    grammar = _grammar(StructuredOutput("regex", "[0-9]{2}x"))
    drafts = _ids("12y3")
    assert grammar.num_valid_drafts(drafts, [], {SIM_EOS}) == 2
    assert grammar.num_valid_drafts(_ids("12x") + [SIM_EOS], [], {SIM_EOS}) == 3  # EOS: cut
    tree_tokens, parents = _ids("1a2x"), [-1, 0, 0, 2]  # 1 -> a (bad), 1 -> 2 -> x
    assert grammar.num_valid_drafts(tree_tokens, parents, {SIM_EOS}) == 1  # node 1 is bad
    assert grammar.num_valid_drafts(_ids("12x"), [-1, 0, 1], {SIM_EOS}) == 3
    assert grammar.live.validate_tokens(drafts) == 2  # nothing was consumed


def test_rejected_draft_suffix_never_reaches_the_matcher() -> None:
    """Verification accepted 2 of 4 drafts: only those and the bonus token are consumed, so
    the state is that of plain decoding (no rollback needed)."""
    grammar = _grammar(StructuredOutput("regex", "[0-9]{4}"))
    plain = _grammar(StructuredOutput("regex", "[0-9]{4}"))
    drafts = _ids("1234")
    assert grammar.num_valid_drafts(drafts, [], {SIM_EOS}) == 4
    for token in drafts[:2] + _ids("9"):  # accepted drafts, then the target's own token
        assert grammar.consume(token)
    for token in _ids("129"):
        assert plain.consume(token)
    assert grammar.forced_tokens(8) == plain.forced_tokens(8) == []
    assert grammar.num_valid_drafts(_ids("5"), [], {SIM_EOS}) == 1
    assert grammar.num_valid_drafts(_ids("55"), [], {SIM_EOS}) == 1


def test_matcher_state_is_the_request_state_across_preemption() -> None:
    """A preempted request keeps its RequestGrammar (it lives on the Request): after the
    recompute the next mask continues where the output left off."""
    grammar = _grammar(StructuredOutput("choice", '["name", "nab"]'))
    assert grammar.consume(_ids("n")[0])
    mask_before = _rows([MaskItem(grammar, 0, [], [])])
    # ... preempted here: blocks freed, tokens kept, nothing re-consumed on recompute ...
    mask_after = _rows([MaskItem(grammar, 0, [], [])])
    assert np.array_equal(mask_before, mask_after)
    assert _allowed(mask_after[0]) == _ids("a")
    assert grammar.consume(_ids("a")[0]) and grammar.forced_tokens(4) == []


def test_forced_tokens_and_stop() -> None:
    grammar = _grammar(StructuredOutput("json_schema", json.dumps(
        {"type": "object", "properties": {"name": {"type": "boolean"}}, "required": ["name"],
         "additionalProperties": False})))
    forced = grammar.forced_tokens(16)
    assert b"".join(TOKENS.tokens[t] for t in forced) == b'{"name": '
    assert grammar.forced_tokens(2) == forced[:2]
    for token in forced + _ids("tr"):
        assert grammar.consume(token)
    assert grammar.forced_tokens(16) == _ids("ue}")  # all that is left is forced
    for token in _ids("ue"):
        assert grammar.consume(token) and not grammar.is_stopped
    assert grammar.consume(_ids("}")[0])
    assert grammar.is_stopped and grammar.error == ""


def test_a_refused_token_is_an_error() -> None:
    grammar = _grammar(StructuredOutput("regex", "[0-9]+"))
    assert not grammar.consume(_ids("x")[0])
    assert grammar.error


# ---------------------------------------------------------------------- masks
def _rows(items: list[MaskItem], executor: llg.LLExecutor | None = None) -> np.ndarray:
    tokenizer = TOKENS.ll_tokenizer()
    return fill_masks(executor, items, mask_words(tokenizer.vocab_size))


def _allowed(row: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist()


def _one_at_a_time(structured: StructuredOutput, path: list[int]) -> list[int]:
    grammar = _grammar(structured)
    for token in path:
        assert grammar.consume(token)
    mask = np.zeros((1, mask_words(len(TOKENS.tokens))), dtype=np.int32)
    lnp.fill_next_token_bitmask(grammar.live, mask, 0)
    return _allowed(mask[0])


def test_draft_rows_equal_masks_after_each_draft() -> None:
    regex = StructuredOutput("regex", "(ab|ac)[0-9]{1,2}")
    choice = StructuredOutput("choice", '["yes", "no"]')
    a, b = _grammar(regex), _grammar(choice)
    drafts = _ids("ab1")
    out = _rows([MaskItem(b, 0, [], []), MaskItem(a, 1, drafts, [])])
    assert out.shape == (5, mask_words(len(TOKENS.tokens)))
    assert _allowed(out[0]) == sorted(_ids("y") + _ids("n"))
    for j in range(4):
        assert _allowed(out[1 + j]) == _one_at_a_time(regex, drafts[:j])
    assert SIM_EOS in _allowed(out[4]) and SIM_EOS not in _allowed(out[3])  # ab1: may stop


def test_tree_rows_follow_each_nodes_path_and_leave_the_state() -> None:
    regex = StructuredOutput("regex", "(ab|ac)[0-9]{1,2}")
    grammar = _grammar(regex)
    tokens, parents = _ids("abc1"), [-1, 0, 0, 1]  # a -> b -> 1, a -> c
    out = _rows([MaskItem(grammar, 0, tokens, parents)])
    paths = [[], tokens[:1], tokens[:2], [tokens[0], tokens[2]], [tokens[0], tokens[1], tokens[3]]]
    for row, path in enumerate(paths):
        assert _allowed(out[row]) == _one_at_a_time(regex, path)
    assert grammar.num_valid_drafts(_ids("ac"), [], {SIM_EOS}) == 2  # state unchanged
    assert sorted(_allowed(_rows([MaskItem(grammar, 0, [], [])])[0])) == _ids("a")


def test_padding_ids_are_never_allowed() -> None:
    """The tokenizer's 116 tokens are fewer than its 4 mask words hold: no bit past the last
    token is set (the worker disallows logits past the words, tests/workers)."""
    grammar = _grammar(StructuredOutput("json_schema", '{"type": "string"}'))
    for token in _ids('"ab'):
        assert grammar.consume(token)
    row = _rows([MaskItem(grammar, 0, [], [])])[0]
    assert len(row) * 32 > len(TOKENS.tokens) > max(_allowed(row)) > 90


def test_parallel_rows_equal_sequential_rows() -> None:
    regex = StructuredOutput("regex", "(ab|ac)[0-9]{1,2}")
    items = [MaskItem(_grammar(regex), 3 * i, _ids("ab") if i % 2 else [], [])
             for i in range(PARALLEL_MIN_ROWS)]
    items = [MaskItem(item.grammar, sum(1 + len(x.drafts) for x in items[:i]), item.drafts, [])
             for i, item in enumerate(items)]
    parallel = _rows(items, llg.LLExecutor(num_threads=2))
    assert np.array_equal(parallel, _rows(items))
    assert len(parallel) >= PARALLEL_MIN_ROWS


def test_the_constraint_engine_is_torch_free() -> None:
    code = ("import sys, justapi.structured.compiler, justapi.structured.masks, "
            "justapi.structured.tokenizer, justapi.scheduler.structured; "
            "found = [m for m in ('torch', 'workers', 'transformers') if m in sys.modules]; "
            "assert not found, found")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
