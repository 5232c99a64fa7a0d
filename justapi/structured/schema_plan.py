"""A JSON Schema -> the schema the grammar engine compiles: exactly (strict) or best effort.

strict (OpenAI's `"strict": true`): the schema as given; a keyword llguidance cannot enforce
exactly is a ValueError naming it (the API's 400). In either mode, keywords beside a `$ref`
are dropped where the schema's draft (7 and before) ignores them (exact), and objects that
list their properties and say nothing of other keys get none (a narrowing: close_objects).
best effort (everything else): every keyword llguidance enforces is enforced; each one it
cannot is replaced by the closest form it can (APPROXIMATIONS: our rewrites first, then
llguidance's own `lenient` and `coerce_one_of` options) and named in the plan, so the API can
report it. A ValueError there means the schema itself is invalid (or nothing compiles it).
Owns: that choice and the keyword report. Does not own: the rewrites (schema_rewrites.py).
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance as llg
from jsonschema import exceptions as schema_errors
from jsonschema import validators

from justapi.structured.grammar import parser_limits, short_error
from justapi.structured.schema_rewrites import (
    close_objects,
    drop_ref_siblings,
    fix_bounds,
    fix_patterns,
    substitute_formats,
)
from justapi.structured.schema_walk import nodes, refs_stand_alone

DROPPED = "dropped"
APPROXIMATIONS: dict[str, str] = {
    "oneOf": "anyOf (an instance may match more than one branch)",
    "format": "a narrower known format (uri-reference, iri, iri-reference, url -> uri; "
              "idn-email -> email; idn-hostname -> hostname), else any string",
    "uniqueItems": DROPPED + " (items may repeat)",
    "propertyNames": DROPPED + " (names follow properties / patternProperties only)",
    "not": DROPPED,
    "if": DROPPED + " (with its then / else)",
    "then": DROPPED,
    "else": DROPPED,
    "dependencies": DROPPED,
    "dependentRequired": DROPPED,
    "dependentSchemas": DROPPED,
    "contains": DROPPED,
    "minContains": DROPPED,
    "maxContains": DROPPED,
    "unevaluatedProperties": DROPPED,
    "unevaluatedItems": DROPPED,
    "minProperties": DROPPED + " where some listed property is optional",
    "maxProperties": DROPPED + " where some listed property is optional",
    "pattern": "look-around groups removed (a superset), else dropped",
    "patternProperties": "key patterns as for pattern (an entry whose key still fails: "
                         "dropped)",
    "minimum": "clamped to -1e18 (a subset), else dropped",
    "maximum": "clamped to 1e18 (a subset), else dropped",
    "exclusiveMinimum": "as minimum",
    "exclusiveMaximum": "as maximum",
    "$ref": "keywords beside a recursive $ref dropped (drafts 2019-09 and later; earlier "
            "drafts ignore them anyway)",
}
"""Keyword -> the closest form best effort compiles instead (docs/structured-outputs.md)."""
OTHER = "other"
"""Reported for an approximation llguidance warns of that APPROXIMATIONS does not name."""
BEST_EFFORT_OPTIONS = {"lenient": True, "coerce_one_of": True}
STRICT_HINT = " (the schema is strict; without \"strict\": true it would be approximated)"
PLAN_CACHE_SIZE = 256
CACHED_MAX_CHARS = 1 << 16
"""Plans of longer schemas are not kept (the cache stays under ~32 MiB whatever is sent)."""


@dataclass(frozen=True)
class SchemaPlan:
    """What to compile for one schema, and what it approximates."""

    spec: str
    """The schema to compile, as JSON text."""
    approximated: tuple[str, ...] = ()
    """Keywords replaced by a closer enforceable form (sorted; empty: exact)."""

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.spec)


def plan_schema(schema: dict[str, Any], *, strict: bool) -> SchemaPlan:
    """The plan for `schema`; ValueError (`json_schema: ...`) for a strict schema with a
    keyword llguidance cannot enforce, or an invalid one."""
    spec = json.dumps(schema, ensure_ascii=False)
    return _cached_plan(spec, strict) if len(spec) <= CACHED_MAX_CHARS else _plan(spec, strict)


@lru_cache(maxsize=PLAN_CACHE_SIZE)
def _cached_plan(spec: str, strict: bool) -> SchemaPlan:
    return _plan(spec, strict)


def _plan(spec: str, strict: bool) -> SchemaPlan:
    schema = json.loads(spec)
    if refs_stand_alone(schema):
        schema, _ = drop_ref_siblings(schema)
    closed = close_objects(schema)
    if closed is not schema and not _validate(closed)[0]:
        return SchemaPlan(_dumps(closed))
    error, _ = _validate(schema)
    if not error:
        return SchemaPlan(_dumps(schema))
    if strict:
        raise ValueError(f"json_schema: {error}{STRICT_HINT}")
    if closed is not schema:
        with contextlib.suppress(ValueError):
            return _best_effort(closed)
    return _best_effort(schema)


def _best_effort(schema: dict[str, Any]) -> SchemaPlan:
    original = schema
    approximated: set[str] = set()
    for rewrite in (substitute_formats, fix_patterns, fix_bounds):
        try:
            schema, keywords = rewrite(schema)
        except ValueError as exc:
            raise ValueError(f"json_schema: {exc}") from None
        approximated.update(keywords)
    own = schema.get("x-guidance")
    schema = {**schema, "x-guidance": {**(own if isinstance(own, dict) else {}),
                                       **BEST_EFFORT_OPTIONS}}
    error, warnings = _validate(schema)
    if error.startswith("circular references with sibling keys"):
        schema, _ = drop_ref_siblings(schema)
        approximated.add("$ref")
        error, warnings = _validate(schema)
    if error:
        raise ValueError(f"json_schema: {_why_invalid(original) or error}")
    approximated.update(_warned_keywords(warnings, original))
    return SchemaPlan(_dumps(schema), tuple(sorted(approximated)))


def _validate(schema: dict[str, Any]) -> tuple[str, list[str]]:
    """(the error, "" if none; the warnings) of compiling `schema` without a tokenizer."""
    grammar = llg.LLMatcher.grammar_from_json_schema(_dumps(schema))
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=parser_limits())
    if is_error:
        return short_error(messages[0] if messages else "invalid"), []
    return "", messages


def _why_invalid(schema: dict[str, Any]) -> str:
    """Why the schema is not a valid JSON Schema of its draft ("" when it is one)."""
    try:
        validators.validator_for(schema).check_schema(schema)
    except schema_errors.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path) or "(root)"
        return short_error(f"the schema is invalid at {where}: {exc.message}")
    return ""


def _warned_keywords(warnings: list[str], schema: dict[str, Any]) -> set[str]:
    """The keywords llguidance's lenient compile approximated, from its warnings."""
    found: set[str] = set()
    for warning in warnings:
        if warning.startswith("Unimplemented keys: "):
            listed = warning[len("Unimplemented keys: "):].split("]")[0] + "]"
            try:
                found.update(str(key) for key in json.loads(listed))
            except ValueError:
                found.add(OTHER)
        elif warning.startswith("Unknown format"):
            found.add("format")
        elif "oneOf" in warning:
            found.add("oneOf")
        elif "min/maxProperties" in warning:
            found.update(key for key in ("minProperties", "maxProperties")
                         if any(key in node for node in nodes(schema)))
        else:
            found.add(OTHER)
    return {key if key in APPROXIMATIONS else OTHER for key in found}


def _dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, ensure_ascii=False)
