"""Structured outputs (torch-free): StructuredOutput -> llguidance grammar and its check
(grammar.py), the vocabulary (tokenizer.py), compiles off the step loop with a cache
(compiler.py), one request's matcher (matcher.py), a step's token bitmasks (masks.py).
The scheduler core uses them in justapi/scheduler/structured.py; the worker applies the
masks (workers/sampler.py apply_token_bitmask)."""
from justapi.structured.grammar import check_structured, grammar_text

__all__ = ["check_structured", "grammar_text"]
