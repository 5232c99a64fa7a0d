"""Finished replies judged against the user's own JSON Schema (not the one compiled), by the
`jsonschema` package: the validator of the schema's draft, formats checked.

A reply decoded under a strict schema is valid by construction (the grammar enforces every
keyword); under best effort an approximated keyword can be broken, and this is where it shows.
Owns: the validators (cached per schema text) and the violation text. Does not own: counting or
logging the outcome (justapi/frontend/reply_checks.py), what was compiled (schema_plan.py).
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jsonschema import FormatChecker, validators
from jsonschema.exceptions import best_match

VALIDATOR_CACHE_SIZE = 256
CACHED_MAX_CHARS = 1 << 16
"""Validators of longer schemas are built per reply, not kept."""
MAX_VIOLATION_CHARS = 300


def first_violation(schema_text: str, instance: Any) -> str:
    """The most relevant way `instance` breaks the schema ("" when it is valid)."""
    try:
        validator = _cached_validator(schema_text) if len(schema_text) <= CACHED_MAX_CHARS \
            else _validator(schema_text)
        error = best_match(validator.iter_errors(instance))
    except Exception as exc:  # a schema jsonschema cannot follow (an unresolvable $ref...)
        return f"the schema could not be applied: {type(exc).__name__}: {exc}"[
            :MAX_VIOLATION_CHARS]
    if error is None:
        return ""
    where = "/".join(str(part) for part in error.absolute_path) or "(root)"
    return f"at {where}: {error.message}"[:MAX_VIOLATION_CHARS]


def json_violation(schema_text: str, text: str) -> str:
    """As first_violation, for a reply's text ("not JSON: ..." when it does not parse)."""
    try:
        instance = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    return first_violation(schema_text, instance)


@lru_cache(maxsize=VALIDATOR_CACHE_SIZE)
def _cached_validator(schema_text: str) -> Any:
    return _validator(schema_text)


def _validator(schema_text: str) -> Any:
    schema = json.loads(schema_text)
    return validators.validator_for(schema)(schema, format_checker=FormatChecker())
