"""A StructuredOutput as an llguidance grammar, and its check: the cheap, tokenizer-free
validation the frontend runs so an unsupported schema or grammar is a 400 naming the feature.

    json_schema / json_object -> llguidance's JSON compiler (whitespace option -> defaults;
                                 the schema's own "x-guidance" options override them)
    regex -> a regex grammar    choice -> Lark alternatives    lark -> as is    gbnf -> Lark
    with reasoning_end: that grammar after free text up to the end of thinking (reasoning.py)
Owns: those translations and the error text. Does not own: compiling against a tokenizer
(compiler.py) or the StructuredOutput fields (justapi/sampling.py).
"""
from __future__ import annotations

import json

import llguidance as llg

from justapi.sampling import StructuredOutput
from justapi.structured.reasoning import after_reasoning

MAX_ERROR_CHARS = 500
MAX_CHOICES = 4096
FLEXIBLE_WHITESPACE = r"(?:| |\n{1,2}[ \t]{0,20})"
"""llama.cpp's bound: nothing, one space, or one or two newlines and up to 20 spaces/tabs."""
JSON_OPTIONS: dict[str, dict] = {
    "spaced": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "compact": {"whitespace_flexible": False},
    "flexible": {"whitespace_flexible": True, "whitespace_pattern": FLEXIBLE_WHITESPACE},
}
"""JSON compile options per StructuredOutput.whitespace (llguidance's `defaults`)."""


def parser_limits() -> llg.LLParserLimits:
    """Resource limits for user grammars; errors never echo the grammar or parser state."""
    return llg.LLParserLimits(verbose_errors=False)


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (behind the thinking block when it has a
    reasoning_end, reasoning.py); ValueError for text that cannot be translated (a choice list
    that is not one, a GBNF grammar that does not parse)."""
    grammar = _answer_grammar(structured)
    if structured.reasoning_end:
        return after_reasoning(grammar, structured.reasoning_end, structured.reasoning_start)
    return grammar


def _answer_grammar(structured: StructuredOutput) -> str:
    kind, spec = structured.kind, structured.spec
    if kind in ("json_schema", "json_object"):
        schema = _schema(spec) if kind == "json_schema" else '{"type": "object"}'
        return llg.LLMatcher.grammar_from_json_schema(
            schema, defaults=JSON_OPTIONS[structured.whitespace])  # type: ignore[arg-type]
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark(_choice_lark(spec))
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(spec)
    try:
        return llg.grammar_from("gbnf", spec)
    except ValueError as exc:
        raise ValueError(f"gbnf: {short_error(str(exc))}") from None


def check_structured(structured: StructuredOutput) -> None:
    """ValueError naming what is wrong or unsupported (e.g. `json_schema: Unimplemented keys:
    ["not"]`) unless the constraint compiles; about a millisecond, no tokenizer needed. Lark
    grammars naming special tokens (<|im_end|>) are checked against the vocabulary only when
    they compile in the scheduler."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        grammar_text(structured), None, limits=parser_limits())
    if is_error:
        raise ValueError(f"{structured.kind}: {short_error(messages[0] if messages else 'invalid')}")


def _schema(spec: str) -> str:
    try:
        json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema: the schema is not JSON ({exc})") from None
    return spec


def _choice_lark(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"choice: the spec must be a JSON list of strings ({exc})") from None
    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"choice: the spec must be a JSON list of 1 to {MAX_CHOICES} "
                         "non-empty strings")
    return "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))


def short_error(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."
