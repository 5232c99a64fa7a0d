"""Output constraints of an API request -> the StructuredOutput its sampling carries.

Reads the constraint fields of every engine whose clients we serve: OpenAI's response_format
(json_object, json_schema), vLLM's structured_outputs (and its older guided_* fields),
llama-server's grammar / json_schema and SGLang's regex / ebnf. At most one constraint per
request (two are a 400 naming the second); each is checked (justapi.structured) before
anything runs, so a schema or grammar that cannot be compiled is a 400 naming the unsupported
feature and the field, never an unconstrained answer. Owns: that mapping. Does not own: what
the grammars accept (justapi/structured/) or tool calls (tools/).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from justapi.frontend.errors import ApiError
from justapi.frontend.openai_models import OutputConstraintFields, StructuredOutputs
from justapi.sampling import StructuredOutput
from justapi.structured import check_structured


@dataclass(frozen=True)
class Constraint:
    """One checked constraint and the request field it came from (for error messages)."""

    structured: StructuredOutput
    param: str


def request_constraint(request: OutputConstraintFields) -> Constraint | None:
    """The request's one output constraint (None: free text); ApiError for two, or for one
    that is malformed or unsupported."""
    found = list(_constraints(request))
    if len(found) > 1:
        raise ApiError(f"a request takes one output constraint; got {found[0].param} and "
                       f"{found[1].param}", param=found[1].param)
    if not found:
        return None
    check(found[0])
    return found[0]


def check(constraint: Constraint) -> None:
    """ApiError (400, param = the field) unless the constraint compiles."""
    try:
        check_structured(constraint.structured)
    except ValueError as exc:
        raise ApiError(f"{constraint.param}: {exc}", param=constraint.param) from None


def _constraints(request: OutputConstraintFields) -> Iterator[Constraint]:
    yield from _response_format(request)
    if request.structured_outputs is not None:
        yield from _structured_outputs(request.structured_outputs, "structured_outputs.")
    for name in ("guided_json", "json_schema"):
        value = getattr(request, name)
        if value is not None:
            yield _json_schema(value, name)
    pairs = (("guided_regex", "regex"), ("regex", "regex"), ("guided_grammar", "gbnf"),
             ("grammar", "gbnf"), ("ebnf", "gbnf"))
    for name, kind in pairs:
        value = getattr(request, name)
        if value is not None:
            yield _make(kind, value, name)
    if request.guided_choice is not None:
        yield _choice(request.guided_choice, "guided_choice")


def _response_format(request: OutputConstraintFields) -> Iterator[Constraint]:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return
    if response_format.schema_ is not None:  # llama-server's {"type": ..., "schema": {...}}
        yield _json_schema(response_format.schema_, "response_format.schema")
        return
    schema = response_format.json_schema.schema_ if response_format.json_schema else None
    if response_format.type == "json_object" or schema is None:
        yield _make("json_object", "", "response_format")
    else:
        yield _json_schema(schema, "response_format.json_schema.schema")


def _structured_outputs(fields: StructuredOutputs, prefix: str) -> Iterator[Constraint]:
    if fields.structural_tag is not None:
        raise ApiError("structured_outputs.structural_tag is not supported (use tools)",
                       param=prefix + "structural_tag")
    if fields.json_ is not None:
        yield _json_schema(fields.json_, prefix + "json")
    if fields.regex is not None:
        yield _make("regex", fields.regex, prefix + "regex")
    if fields.choice is not None:
        yield _choice(fields.choice, prefix + "choice")
    if fields.grammar is not None:
        yield _make("gbnf", fields.grammar, prefix + "grammar")
    if fields.json_object:
        yield _make("json_object", "", prefix + "json_object")


def _json_schema(schema: dict[str, Any] | str, param: str) -> Constraint:
    """A schema object, or its JSON text (SGLang, vLLM accept both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ApiError(f"{param}: the schema is not JSON ({exc})", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(f"{param}: a JSON Schema must be an object", param=param)
    return _make("json_schema", json.dumps(schema, ensure_ascii=False), param)


def _choice(choices: list[str], param: str) -> Constraint:
    return _make("choice", json.dumps(choices, ensure_ascii=False), param)


def _make(kind: str, spec: str, param: str) -> Constraint:
    try:
        return Constraint(StructuredOutput(kind=kind, spec=spec), param)
    except ValueError as exc:
        raise ApiError(f"{param}: {exc}", param=param) from None
