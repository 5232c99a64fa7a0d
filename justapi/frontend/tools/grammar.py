"""The grammar (llguidance's Lark dialect) that constrains a reply with tool calls.

The calls are written exactly as the format's `write_calls` writes them, the arguments of
each tool bound by its `parameters` schema (%json, one line, json.dumps' separators):

    required / a named tool:  start: <calls>              (no text; a named tool: one call)
    auto:                     start: TEXT | trigger <rest of calls>
                              trigger[lazy]: TEXT "<trigger>"  (free text until the trigger)
    auto, start-only format:  start: PLAIN | <calls>       (Llama 3: PLAIN is any text that
                                                            does not open with the trigger)

so with `auto` the model may answer in text, and a call, once its trigger is written, is
constrained. A call of one tool may not be followed by another unless parallel calls are
allowed. Pieces that are special tokens of the vocabulary (Mistral's [TOOL_CALLS], [ARGS],
[CALL_ID]) are named by id. Owns: the grammar text. Does not own: the format (formats.py),
compiling it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from justapi.frontend.tools.formats import ToolFormat

ARGUMENT_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ",
                         "key_separator": ": "}
"""Arguments as json.dumps writes them (and as chat templates render past calls)."""
TEXT_RULE = "TEXT: /(.|\\n)*/"
_PLACEHOLDER = "\x00"


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the grammar sees it: `parameters` is what compiles (a best-effort schema's
    approximated form)."""

    name: str
    parameters: dict[str, Any]


def tool_call_lark(tool_format: ToolFormat, tools: Sequence[ToolSpec], *, is_required: bool,
                   is_parallel: bool, special_ids: Mapping[str, int] | None = None) -> str:
    """The Lark grammar of a reply that calls `tools` (is_required: calls and nothing else;
    otherwise text, or text and then calls). special_ids: the format's markers that are
    special tokens of the vocabulary, by text."""
    pieces = _Pieces(special_ids or {})
    head, sep, tail = _frame(tool_format)
    many = f" ({pieces.seq(sep)} tc_call)*" if is_parallel and tool_format.is_parallel else ""
    calls = f"tc_call{many} {pieces.seq(tail)}".strip()
    rules = [f"tc_call: {_alternatives(tool_format, tools, pieces)}"]
    trigger = tool_format.trigger
    if is_required:
        start = f"{pieces.seq(head)} {calls}"
    elif trigger in pieces.special_ids:
        start = f"TEXT | TEXT {pieces.seq(head)} {calls}"
        rules.append(TEXT_RULE)
    elif tool_format.is_start_only:
        start = f"PLAIN | {pieces.seq(head)} {calls}"
        rules.append(f"PLAIN: /(.|\\n)*/ & ~/[ \\t\\n]*{re.escape(trigger)}(.|\\n)*/")
    elif not tool_format.keeps_trigger:
        start = f"TEXT | tc_trigger {pieces.seq(head[1:])} {calls}"
        rules += [f"tc_trigger[lazy]: TEXT {pieces.seq([trigger])}", TEXT_RULE]
    else:  # the trigger opens the first call's own text (the generic envelope)
        opening = "".join(head)
        start = f"TEXT | tc_trigger {pieces.seq([opening[len(trigger):]])} {calls}"
        rules += [f"tc_trigger[lazy]: TEXT {pieces.seq([trigger])}", TEXT_RULE]
    return "\n".join(["%llguidance {}", f"start: {' '.join(start.split())}", *rules]) + "\n"


class _Pieces:
    """Literal pieces as Lark: a special token by id, else a string literal."""

    def __init__(self, special_ids: Mapping[str, int]) -> None:
        self.special_ids = special_ids

    def one(self, text: str) -> str:
        token_id = self.special_ids.get(text)
        if token_id is not None:
            return f"<[{token_id}]>"
        return json.dumps(text) if text else ""

    def seq(self, pieces: Sequence[str]) -> str:
        """Consecutive plain pieces merged into one literal, special tokens apart."""
        out: list[str] = []
        plain = ""
        for piece in pieces:
            if piece in self.special_ids:
                out += [self.one(plain), self.one(piece)]
                plain = ""
            else:
                plain += piece
        out.append(self.one(plain))
        return " ".join(part for part in out if part)


def _frame(tool_format: ToolFormat) -> tuple[list[str], list[str], list[str]]:
    """The pieces before the first call (the trigger first, unless it is the call's own
    text), between two calls, and after the last."""
    after = list(tool_format.after_call)
    head = list(tool_format.opener) if tool_format.keeps_trigger \
        else [tool_format.trigger, *tool_format.opener]
    return head, after + list(tool_format.between), after + list(tool_format.closer)


def _alternatives(tool_format: ToolFormat, tools: Sequence[ToolSpec], pieces: _Pieces) -> str:
    return " | ".join(_call_rule(tool_format, tool, pieces) for tool in tools)


def _call_rule(tool_format: ToolFormat, tool: ToolSpec, pieces: _Pieces) -> str:
    """One call of `tool`: its fixed text around the arguments."""
    own = tool.parameters.get("x-guidance")
    options = {**ARGUMENT_JSON_OPTIONS, **(own if isinstance(own, dict) else {})}
    arguments = f"%json {json.dumps({**tool.parameters, 'x-guidance': options})}"
    if tool_format.args_marker:
        call_id = ""
        if tool_format.id_marker:
            call_id = (f"{pieces.one(tool_format.id_marker)} "
                       f"/[A-Za-z0-9]{{{tool_format.id_length}}}/")
        return (f"{pieces.one(tool.name)} {call_id} {pieces.one(tool_format.args_marker)} "
                f"{arguments}").replace("  ", " ")
    before, after = tool_format.write_call(tool.name, _PLACEHOLDER).split(_PLACEHOLDER)
    return f"{pieces.one(before)} {arguments} {pieces.one(after)}".strip()
