"""Output constraints of an API request -> the StructuredOutput its sampling carries.

Reads the constraint fields of every engine whose clients we serve: OpenAI's response_format
(json_object, json_schema), vLLM's structured_outputs (and its older guided_* fields),
llama-server's grammar / json_schema and SGLang's regex / ebnf. At most one constraint per
request (two are a 400 naming the second); each is checked (justapi.structured) before
anything runs, never an unconstrained answer. A JSON Schema compiles exactly when its request
says `"strict": true` (a keyword that cannot be enforced is a 400 naming it and the field),
best effort otherwise (justapi/structured/schema_plan.py: what cannot be enforced is
approximated and reported). Owns: that mapping. Does not own: what the grammars accept
(justapi/structured/) or tool calls (tools/).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from justapi.frontend.choices import OutputRules
from justapi.frontend.errors import ApiError
from justapi.frontend.openai_models import OutputConstraintFields, StructuredOutputs
from justapi.frontend.structured_replies import JsonReplyCheck, StructuredMetrics
from justapi.sampling import StructuredOutput
from justapi.structured import check_structured
from justapi.structured.schema_plan import plan_schema

APPROXIMATED_HEADER = "X-Schema-Approximated"
"""Response header: the schema keywords best effort approximated, comma-separated."""


@dataclass(frozen=True)
class Constraint:
    """One checked constraint and the request field it came from (for error messages)."""

    structured: StructuredOutput
    """What is compiled (a best-effort schema: its approximated form)."""
    param: str
    schema_text: str = ""
    """json_schema: the user's own schema (replies are judged against it)."""
    is_strict: bool = False
    approximated: tuple[str, ...] = ()
    """Keywords best effort replaced by a closer enforceable form."""


def request_constraint(request: OutputConstraintFields) -> Constraint | None:
    """The request's one output constraint (None: free text); ApiError for two, or for one
    that is malformed or unsupported."""
    found = list(_constraints(request))
    if len(found) > 1:
        raise ApiError(f"a request takes one output constraint; got {found[0].param} and "
                       f"{found[1].param}", param=found[1].param)
    if not found:
        return None
    return planned(found[0])


def planned(constraint: Constraint) -> Constraint:
    """The constraint as it compiles: a JSON Schema planned (strict or best effort), any other
    kind checked; ApiError (400, param = the field) when it cannot compile."""
    structured = constraint.structured
    if structured.kind != "json_schema":
        check(constraint)
        return constraint
    if constraint.schema_text:
        return constraint  # planned already
    try:
        plan = plan_schema(json.loads(structured.spec), strict=constraint.is_strict)
    except ValueError as exc:
        raise ApiError(f"{constraint.param}: {exc}", param=constraint.param) from None
    return dataclasses.replace(
        constraint, structured=dataclasses.replace(structured, spec=plan.spec),
        schema_text=structured.spec, approximated=plan.approximated)


def output_rules(metrics: StructuredMetrics, constraint: Constraint | None) -> OutputRules:
    """What the request's output must be (and how it is judged once finished); counts the
    keywords its schema approximated."""
    if constraint is None:
        return OutputRules()
    metrics.count_approximated(constraint.approximated)
    watch = None
    if constraint.schema_text:
        watch = partial(JsonReplyCheck, metrics, constraint.schema_text, constraint.is_strict,
                        constraint.param)
    return OutputRules(constraint.structured, param=constraint.param,
                       approximated=constraint.approximated, watch=watch)


def approximated_header(keywords: tuple[str, ...]) -> dict[str, str]:
    """The response header naming approximated keywords (none: no header)."""
    return {APPROXIMATED_HEADER: ", ".join(keywords)} if keywords else {}


def check(constraint: Constraint) -> None:
    """ApiError (400, param = the field) unless the constraint compiles as it is."""
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
    json_schema = response_format.json_schema
    schema = json_schema.schema_ if json_schema else None
    if response_format.type == "json_object" or json_schema is None or schema is None:
        yield _make("json_object", "", "response_format")
    else:
        yield _json_schema(schema, "response_format.json_schema.schema",
                           is_strict=bool(json_schema.strict))


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


def _json_schema(schema: dict[str, Any] | str, param: str, *,
                 is_strict: bool = False) -> Constraint:
    """A schema object, or its JSON text (SGLang, vLLM accept both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ApiError(f"{param}: the schema is not JSON ({exc})", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(f"{param}: a JSON Schema must be an object", param=param)
    constraint = _make("json_schema", json.dumps(schema, ensure_ascii=False), param)
    return dataclasses.replace(constraint, is_strict=is_strict)


def _choice(choices: list[str], param: str) -> Constraint:
    return _make("choice", json.dumps(choices, ensure_ascii=False), param)


def _make(kind: str, spec: str, param: str) -> Constraint:
    try:
        return Constraint(StructuredOutput(kind=kind, spec=spec), param)
    except ValueError as exc:
        raise ApiError(f"{param}: {exc}", param=param) from None
