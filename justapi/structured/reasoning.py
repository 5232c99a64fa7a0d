"""A constraint that starts after a reasoning model's thinking: free text up to the end of the
thinking block (`</think>`), a little whitespace, then the constraint's own grammar.

    open thinking (the prompt opened it):  start: THINKING GAP @answer
    thinking optional:                      start: @answer | START THINKING GAP @answer
    THINKING, a marker that is text:        any text up to and including the first `</think>`
    THINKING, a marker that is a token:     any text, then that token (`<[id]>`)

The answer is the constraint's grammar nested by name (llguidance's `@name`), so every kind
(JSON Schema, regex, Lark, GBNF, tool calls) composes the same way. Every text token (and the
end marker's token) is allowed while thinking, so greedy output matches the unconstrained
output until the thinking ends; only special tokens (EOS among them) are refused there.
Owns: that composition. Does not own: the answer's grammar (grammar.py) or which markers a
model uses (justapi/frontend/reasoning/).
"""
from __future__ import annotations

import json
import re
from typing import Any

ANSWER_NAME = "reasoning_answer"
MAX_GAP_CHARS = 8
"""Whitespace allowed between the end of thinking and the answer (models write one or two
newlines)."""
TOKEN_MARKER = re.compile(r"<\[(\d+)\]>")
"""A marker that is one token of the vocabulary, by id (llguidance's syntax)."""


def after_reasoning(grammar: str, reasoning_end: str, reasoning_start: str = "") -> str:
    """The TopLevelGrammar (JSON) of `grammar` (llguidance JSON, or Lark text) behind a
    thinking block that ends with `reasoning_end`; `reasoning_start` set: the thinking is
    optional and opens with it. Markers: text, or `<[id]>` for one token."""
    grammars = _grammar_list(grammar)
    answer = grammars[0]
    name = answer.get("name") or ANSWER_NAME
    answer["name"] = name
    thinking = f"reasoning_text REASONING_GAP @{name}"
    start = f"@{name} | {_item(reasoning_start)} {thinking}" if reasoning_start else thinking
    if TOKEN_MARKER.fullmatch(reasoning_end):  # text until the marker's token
        text_rule = f"reasoning_text: REASONING_TEXT {reasoning_end}"
    else:  # text until the marker's first occurrence
        text_rule = f"reasoning_text[lazy]: REASONING_TEXT {_item(reasoning_end)}"
    lark = "\n".join([
        "%llguidance {}",
        f"start: {start}",
        text_rule,
        "REASONING_TEXT: /(.|\\n)*/",
        f"REASONING_GAP: /[ \\t\\r\\n]{{0,{MAX_GAP_CHARS}}}/",
    ]) + "\n"
    return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]})


def _grammar_list(grammar: str) -> list[dict[str, Any]]:
    """The grammar's list of grammars (the first is its start); Lark text becomes one."""
    try:
        top = json.loads(grammar)
    except ValueError:
        top = None
    if isinstance(top, dict) and isinstance(top.get("grammars"), list) and top["grammars"]:
        return [dict(entry) for entry in top["grammars"]]
    return [{"lark_grammar": grammar}]


def _item(marker: str) -> str:
    """A marker as a Lark item: its token, or its text as a literal."""
    return marker if TOKEN_MARKER.fullmatch(marker) else json.dumps(marker)
