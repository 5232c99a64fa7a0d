"""Rewrites of JSON Schema parts the grammar engine cannot take, into the closest form it can.

`close_objects` narrows (every instance it allows is still valid): an object that lists its
`properties` and says nothing of other keys gets no other keys, as llama.cpp's converter does
(a small model otherwise invents keys until max_tokens). Each rewrite below returns the new
schema and the keywords it changed:
- keywords beside a `$ref` are dropped (draft 7 and before ignore them: exact; later drafts
  apply them, so there it is an approximation, used only where a recursive `$ref` has them);
- a `pattern` (or a `patternProperties` key) llguidance cannot parse (look-around,
  back-references) loses its look-around groups, a superset, or else the pattern;
- numeric bounds llguidance cannot write as a regex (below -2^63, beyond 1e18) are clamped
  into range (a subset: every value allowed is still valid), or else dropped;
- a `format` llguidance does not know but has a narrower one for (`uri-reference` -> `uri`)
  is replaced by it; other unknown formats are left to llguidance's lenient mode (a string).
Owns: those rewrites and the probes that find what needs them. Does not own: which to apply
(schema_plan.py) or the traversal (schema_walk.py).
"""
from __future__ import annotations

import json
import re
from typing import Any

import llguidance as llg

from justapi.structured.schema_walk import Node, transform

REF_CONTAINERS = ("$ref", "definitions", "$defs", "$id", "id", "$schema")
"""Kept beside a `$ref` when its siblings are dropped (they hold or name other schemas)."""
FORMAT_SUBSETS = {"uri-reference": "uri", "iri": "uri", "iri-reference": "uri", "url": "uri",
                  "idn-email": "email", "idn-hostname": "hostname"}
"""Unknown formats with a known format whose strings are all valid for them."""
BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_BOUND = 1e18
"""llguidance writes numeric ranges as regexes; beyond this magnitude some fail."""
LOOKAROUND_OPENERS = ("(?=", "(?!", "(?<=", "(?<!")


OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf",
             "anyOf", "oneOf", "$ref", "$dynamicRef", "$recursiveRef", "if", "then", "else",
             "not", "dependencies", "dependentSchemas", "propertyNames")
"""An object node with one of these says (or may say, through another schema) what other
keys it takes: it is left as it is."""
PLAIN_PATHS = ("properties", "items", "prefixItems", "additionalProperties")
"""Where close_objects looks for objects: not under combinators or definitions, whose
subschemas meet other schemas (an `allOf` branch closed would refuse its sibling's keys)."""


def close_objects(schema: Any) -> Any:
    """Objects listing `properties` with nothing about other keys -> `additionalProperties:
    false`, along plain paths from the root (PLAIN_PATHS)."""
    if not isinstance(schema, dict):
        return schema
    out = schema
    if "properties" in schema and not any(key in schema for key in OPEN_KEYS):
        out = {**schema, "additionalProperties": False}
    changed: dict[str, Any] = {}
    for key in PLAIN_PATHS:
        value = out.get(key)
        if key == "properties" and isinstance(value, dict):
            new: Any = {name: close_objects(sub) for name, sub in value.items()}
            if any(new[name] is not value[name] for name in value):
                changed[key] = new
        elif isinstance(value, list):
            items = [close_objects(sub) for sub in value]
            if any(a is not b for a, b in zip(items, value)):
                changed[key] = items
        elif isinstance(value, dict) and key != "properties":
            new = close_objects(value)
            if new is not value:
                changed[key] = new
    return {**out, **changed} if changed else out


def drop_ref_siblings(schema: Any) -> tuple[Any, bool]:
    """Every `{"$ref": ..., other keys}` reduced to the `$ref` (and the containers beside it);
    True if any key was dropped."""
    dropped = False

    def rewrite(node: Node) -> Node:
        nonlocal dropped
        if "$ref" not in node or all(key in REF_CONTAINERS for key in node):
            return node
        dropped = True
        return {key: value for key, value in node.items() if key in REF_CONTAINERS}

    return transform(schema, rewrite), dropped


def fix_patterns(schema: Any) -> tuple[Any, list[str]]:
    """Patterns llguidance refuses -> without look-around, or dropped; ValueError for one
    that is no regular expression at all (the schema is invalid)."""
    changed: set[str] = set()

    def rewrite(node: Node) -> Node:
        out = node
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not pattern_compiles(pattern):
            _check_regex(pattern)
            changed.add("pattern")
            fixed = strip_lookaround(pattern)
            out = {k: v for k, v in node.items() if k != "pattern"}
            if fixed != pattern and pattern_compiles(fixed):
                out["pattern"] = fixed
        keyed = node.get("patternProperties")
        if isinstance(keyed, dict) and not all(pattern_compiles(key) for key in keyed):
            changed.add("patternProperties")
            out = {**out, "patternProperties": _fixed_keys(keyed)}
        return out

    return transform(schema, rewrite), sorted(changed)


def _fixed_keys(keyed: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in keyed.items():
        if not pattern_compiles(key):
            _check_regex(key)
            key = strip_lookaround(key)
            if not pattern_compiles(key):
                continue  # names it matched fall to additionalProperties
        out.setdefault(key, value)
    return out


def fix_bounds(schema: Any) -> tuple[Any, list[str]]:
    """Numeric bounds llguidance cannot write -> clamped into +-MAX_BOUND, or dropped."""
    changed: set[str] = set()

    def rewrite(node: Node) -> Node:
        bounds = {k: node[k] for k in BOUND_KEYS if _is_number(node.get(k))}
        if not bounds or _compiles({"type": node.get("type", "number"), **bounds}):
            return node
        clamped = {k: _clamp(k, v) for k, v in bounds.items()}
        if _compiles({"type": node.get("type", "number"), **clamped}):
            changed.update(k for k in bounds if clamped[k] != bounds[k])
            return {**node, **clamped}
        changed.update(bounds)
        return {k: v for k, v in node.items() if k not in bounds}

    return transform(schema, rewrite), sorted(changed)


def _clamp(key: str, value: float) -> float:
    """A lower bound below -MAX_BOUND rises to it, an upper bound above MAX_BOUND falls to it
    (fewer values, all valid); a bound that is itself in range stays."""
    if key in ("minimum", "exclusiveMinimum") and value < -MAX_BOUND:
        return -MAX_BOUND if isinstance(value, float) else -int(MAX_BOUND)
    if key in ("maximum", "exclusiveMaximum") and value > MAX_BOUND:
        return MAX_BOUND if isinstance(value, float) else int(MAX_BOUND)
    return value


def substitute_formats(schema: Any) -> tuple[Any, list[str]]:
    """Unknown formats with a narrower known one -> that one."""
    changed: list[str] = []

    def rewrite(node: Node) -> Node:
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in FORMAT_SUBSETS:
            changed.append("format")
            return {**node, "format": FORMAT_SUBSETS[fmt]}
        return node

    return transform(schema, rewrite), sorted(set(changed))


def strip_lookaround(pattern: str) -> str:
    """The pattern without its look-around groups ((?=..), (?!..), (?<=..), (?<!..)): every
    string it matched still matches."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith(LOOKAROUND_OPENERS, i):
            i = _group_end(pattern, i)
            continue
        end = _atom_end(pattern, i)
        out.append(pattern[i:end])
        i = end
    return "".join(out)


def _atom_end(pattern: str, i: int) -> int:
    """The end of the escape or character class starting at i (else of one character)."""
    if pattern[i] == "\\":
        return min(i + 2, len(pattern))
    if pattern[i] != "[":
        return i + 1
    j = i + 1
    if pattern.startswith("^", j):
        j += 1
    if pattern.startswith("]", j):  # a leading "]" is a literal
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return min(j + 1, len(pattern))


def _group_end(pattern: str, i: int) -> int:
    """The index after the group opened at i (its closing parenthesis)."""
    depth = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i = _atom_end(pattern, i) if char in "\\[" else i + 1
    return len(pattern)


def _check_regex(pattern: str) -> None:
    """ValueError unless the pattern is a regular expression (Python's dialect is close
    enough to ECMA 262's for this: look-around and back-references are both)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"the schema is invalid: pattern {pattern!r} is not a regular "
                         f"expression ({exc})") from None


def pattern_compiles(pattern: str) -> bool:
    return _compiles({"type": "string", "pattern": pattern})


def _compiles(schema: dict[str, Any]) -> bool:
    grammar = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), overrides={"whitespace_flexible": False})
    is_error, _ = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return not is_error


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
