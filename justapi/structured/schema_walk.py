"""Where a JSON Schema keeps its subschemas, and a copy-on-write walk over them.

JSON Schema nests schemas under known keywords only (`properties` maps names to schemas,
`allOf` lists them, `not` holds one, `items` one or a list, `dependencies` a schema or a list
of names); everything else is a value, even a property named "$ref". `transform` applies a
function to every schema node, parents before children, and copies only what it changes.
Owns: that traversal. Does not own: what a rewrite does (schema_rewrites.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
"""Keywords whose value maps names to schemas."""
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
"""Keywords whose value is a list of schemas."""
SCHEMA_ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames",
              "not", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
"""Keywords whose value is one schema (`items` may also be a list: draft 4-7 tuples)."""
DRAFTS_REF_ALONE = ("draft-03", "draft-04", "draft-06", "draft-07")
"""Drafts in which keywords beside a `$ref` are ignored (2019-09 on applies them)."""

Node = dict[str, Any]
Rewrite = Callable[[Node], Node]


def transform(schema: Any, rewrite: Rewrite) -> Any:
    """`schema` with `rewrite` applied to every schema node (the node first, then the
    subschemas of what it returned); unchanged parts are shared, not copied."""
    if not isinstance(schema, dict):
        return schema  # true / false schemas
    node = rewrite(schema)
    changed: dict[str, Any] = {}
    for key, value in node.items():
        new = _transform_value(key, value, rewrite)
        if new is not value:
            changed[key] = new
    return {**node, **changed} if changed else node


def _transform_value(key: str, value: Any, rewrite: Rewrite) -> Any:
    if key in SCHEMA_MAPS and isinstance(value, dict):
        return _map_dict(value, lambda v: transform(v, rewrite))
    if key in SCHEMA_LISTS and isinstance(value, list):
        return _map_list(value, lambda v: transform(v, rewrite))
    if key in SCHEMA_ONE:
        if isinstance(value, list):  # draft 4-7 tuple `items`
            return _map_list(value, lambda v: transform(v, rewrite))
        return transform(value, rewrite)
    if key == "dependencies" and isinstance(value, dict):  # a schema, or a list of names
        return _map_dict(value, lambda v: transform(v, rewrite) if isinstance(v, dict) else v)
    return value


def _map_dict(value: dict[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    out = {k: fn(v) for k, v in value.items()}
    return value if all(out[k] is value[k] for k in value) else out


def _map_list(value: list[Any], fn: Callable[[Any], Any]) -> list[Any]:
    out = [fn(v) for v in value]
    return value if all(a is b for a, b in zip(out, value)) else out


def nodes(schema: Any) -> Iterator[Node]:
    """Every schema node, parents first."""
    found: list[Node] = []

    def visit(node: Node) -> Node:
        found.append(node)
        return node

    transform(schema, visit)
    yield from found


def refs_stand_alone(schema: Any) -> bool:
    """Whether the schema's draft ignores keywords beside `$ref` (draft 7 and before)."""
    declared = schema.get("$schema", "") if isinstance(schema, dict) else ""
    return isinstance(declared, str) and any(draft in declared for draft in DRAFTS_REF_ALONE)
