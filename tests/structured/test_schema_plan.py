"""JSON Schemas planned strict or best effort: every public schema of the shared corpus compiles
both ways (strict refuses exactly the schemas that need an approximation, naming one of its
documented keywords; best effort accepts all of them, each approximation documented), BFCL's
tool parameters compile as they are, the rewrites keep what they promise (look-around removed
gives a superset, clamped bounds a subset, `$ref` siblings dropped only where the draft ignores
them), and the replies' validator judges the user's own schema."""
from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance as llg
import pytest

from justapi.frontend.tools.formats import GENERIC
from justapi.frontend.tools.grammar import ToolSpec, tool_call_lark
from justapi.sampling import StructuredOutput
from justapi.structured import check_structured
from justapi.structured.schema_plan import APPROXIMATIONS, plan_schema
from justapi.structured.schema_rewrites import drop_ref_siblings, strip_lookaround
from justapi.structured.validation import json_violation
from tools.corpora import corpora_dir, schema_cases, tool_cases

ROOT = corpora_dir()
needs_corpora = pytest.mark.skipif(ROOT is None, reason="no shared corpora beside the checkout "
                                   "(../shared/corpora, or set JUSTAPI_CORPORA)")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "structured-outputs.md"


@needs_corpora
def test_every_corpus_schema_compiles_strict_or_is_refused_by_a_documented_keyword():
    assert ROOT is not None
    cases = schema_cases(ROOT)
    assert len(cases) == 80
    num_strict = 0
    for case in cases:
        best = plan_schema(case.schema, strict=False)  # best effort: every one is accepted
        check_structured(StructuredOutput("json_schema", best.spec))
        assert set(best.approximated) <= set(APPROXIMATIONS), case.file
        try:
            strict = plan_schema(case.schema, strict=True)
        except ValueError as exc:  # refused: exactly when best effort approximates, naming it
            assert _refused_for(str(exc)) & set(best.approximated), (case.file, str(exc))
            continue
        num_strict += 1
        assert best.approximated == () and strict.spec == best.spec, case.file
    assert 20 <= num_strict < 80


def _refused_for(message: str) -> set[str]:
    """The keywords a strict refusal names (llguidance's wording)."""
    listed = re.search(r"Unimplemented keys: (\[[^]]*\])", message)
    found = set(json.loads(listed.group(1))) if listed else set()
    for needle, keywords in (("Unknown format", {"format"}), ("oneOf", {"oneOf"}),
                             ("look-around", {"pattern", "patternProperties"}),
                             ("range", {"minimum", "maximum"}), ("circular", {"$ref"}),
                             ("min/maxProperties", {"minProperties", "maxProperties"})):
        if needle in message:
            found |= keywords
    return found


def test_every_documented_approximation_is_in_the_docs():
    text = DOCS.read_text()
    for keyword in APPROXIMATIONS:
        assert f"`{keyword}`" in text, keyword


@needs_corpora
def test_bfcl_tool_parameters_compile_exactly():
    assert ROOT is not None
    for case in tool_cases(ROOT):
        specs = []
        for tool in case.tools:
            plan = plan_schema(tool["function"]["parameters"], strict=False)
            assert plan.approximated == (), case.id
            specs.append(ToolSpec(tool["function"]["name"], plan.schema))
        lark = tool_call_lark(GENERIC, specs, is_required=True, is_parallel=True)
        check_structured(StructuredOutput("lark", lark))


def test_best_effort_is_reported_and_invalid_schemas_are_refused():
    schema = {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^(?!tmp)[a-z]+$"},
        "n": {"type": "integer", "minimum": -2 ** 63, "maximum": 10},
        "link": {"type": "string", "format": "uri-reference"},
        "pair": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "mode": {"not": {"const": "x"}}}}
    with pytest.raises(ValueError, match="strict"):
        plan_schema(schema, strict=True)
    plan = plan_schema(schema, strict=False)
    assert plan.approximated == ("format", "minimum", "not", "pattern", "uniqueItems")
    compiled = plan.schema["properties"]
    assert compiled["id"]["pattern"] == "^[a-z]+$"
    assert compiled["n"]["minimum"] == -10 ** 18 and compiled["n"]["maximum"] == 10
    assert compiled["link"]["format"] == "uri"
    assert plan.schema["x-guidance"] == {"lenient": True, "coerce_one_of": True}
    for invalid in ({"type": "strin"}, {"type": "object", "required": "a"},
                    {"properties": {"a": {"$ref": "#/nowhere"}}},
                    {"type": "string", "pattern": "(unclosed"}):
        with pytest.raises(ValueError, match="json_schema: "):
            plan_schema(invalid, strict=False)


def test_lookaround_is_removed_and_the_rest_kept():
    assert strip_lookaround(r"^(?!@@)[@a-z(?!]+$") == r"^[@a-z(?!]+$"
    assert strip_lookaround(r"a(?=(b|c)\))d(?<!x)") == "ad"
    assert strip_lookaround(r"\(?!x") == r"\(?!x"  # an escaped parenthesis opens nothing


def test_ref_siblings_are_dropped_only_where_the_draft_ignores_them():
    node = {"definitions": {"n": {"type": "array", "items": {
        "$ref": "#/definitions/n", "maxItems": 2, "description": "x"}}}, "$ref": "#/definitions/n"}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **node}
    assert plan_schema(draft7, strict=True).approximated == ()  # exact: draft 7 ignores them
    dropped, changed = drop_ref_siblings(node)
    assert changed and dropped["definitions"]["n"]["items"] == {"$ref": "#/definitions/n"}
    latest = {"$schema": "https://json-schema.org/draft/2020-12/schema", **node}
    assert plan_schema(latest, strict=False).approximated == ("$ref",)
    with pytest.raises(ValueError, match="circular"):
        plan_schema(latest, strict=True)


def test_replies_are_judged_against_the_users_own_schema():
    schema = json.dumps({"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True}, "at": {"type": "string",
                                                           "format": "date"}},
        "required": ["tags"]})
    assert json_violation(schema, '{"tags": [1, 2], "at": "2024-01-31"}') == ""
    assert "non-unique" in json_violation(schema, '{"tags": [1, 1]}')
    assert "at at: " in json_violation(schema, '{"tags": [], "at": "31/01/2024"}')
    assert json_violation(schema, '{"tags": [').startswith("not JSON")


def test_planning_a_large_schema_is_quick_and_cached():
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "uniqueItems": True}
                                               for i in range(300)}}
    first = plan_schema(schema, strict=False)
    assert plan_schema(schema, strict=False) is first  # cached by the schema's text
    assert llg.LLMatcher.validate_grammar(
        llg.LLMatcher.grammar_from_json_schema(first.spec)) == ""


def test_objects_that_list_their_properties_get_no_others():
    """A narrowing (as llama.cpp's converter does): every reply still validates, and an object
    whose other keys another schema may name (a combinator, a $ref) is left open."""
    base = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {"type": "object", "properties": {
        "plain": base, "list": {"type": "array", "items": base},
        "merged": {"allOf": [base, {"properties": {"b": {"type": "string"}}}]},
        "open": {**base, "patternProperties": {"^x": {}}}}}
    compiled = plan_schema(schema, strict=True).schema
    props = compiled["properties"]
    assert compiled["additionalProperties"] is False
    assert props["plain"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["merged"] == schema["properties"]["merged"]  # allOf branches stay open
    assert "additionalProperties" not in props["open"]
    assert plan_schema({**base, "additionalProperties": True}, strict=True).schema == {
        **base, "additionalProperties": True}
