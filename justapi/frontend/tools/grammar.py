"""The grammar (llguidance's Lark dialect) that constrains a reply with tool calls.

The calls are written exactly as the format's `write_calls` writes them, the arguments of
each tool bound by its `parameters` schema (%json, one line, json.dumps' separators):

    required / a named tool:  start: <calls>              (no text; a named tool: one call)
    auto:                     start: TEXT | trigger <rest of calls>
                              trigger[lazy]: TEXT "<trigger>"  (free text until the trigger)

so with `auto` the model may answer in text, and a call, once its trigger is written, is
constrained. A trigger that is one special token of the vocabulary (Mistral's [TOOL_CALLS])
is named by id. Owns: the grammar text. Does not own: the format (formats.py), compiling it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
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
    """One tool as the grammar sees it."""

    name: str
    parameters: dict[str, Any]


def tool_call_lark(tool_format: ToolFormat, tools: Sequence[ToolSpec], *, is_required: bool,
                   is_parallel: bool, trigger_token_id: int | None = None) -> str:
    """The Lark grammar of a reply that calls `tools` (is_required: calls and nothing else;
    otherwise text, or text and then calls). trigger_token_id: the trigger is this special
    token (not text)."""
    head, sep, tail = _frame(tool_format)
    many = f" ({_lit(sep)} tc_call)*" if is_parallel and tool_format.is_parallel else ""
    trigger = tool_format.trigger
    rules = [f"tc_call: {_alternatives(tool_format, tools)}"]
    if trigger_token_id is not None:
        head_rule = f"<[{trigger_token_id}]> {_lit(head[len(trigger):])}"
        start = head_rule if is_required else f"TEXT | TEXT {head_rule}"
        start += f" tc_call{many} {_lit(tail)}"
        rules.append(TEXT_RULE)
    elif is_required:
        start = f"{_lit(head)} tc_call{many} {_lit(tail)}"
    else:
        if head.startswith(trigger):
            start = f"TEXT | tc_trigger {_lit(head[len(trigger):])} tc_call{many} {_lit(tail)}"
        else:  # the trigger opens the first call itself (Llama 3)
            start = f"TEXT | tc_trigger {_lit(head)} tc_first{many} {_lit(tail)}"
            rules.append(f"tc_first: {_alternatives(tool_format, tools, drop=len(trigger))}")
        rules += [f"tc_trigger[lazy]: TEXT {_lit(trigger)}", TEXT_RULE]
    return "\n".join(["%llguidance {}", f"start: {start}", *rules]) + "\n"


def _alternatives(tool_format: ToolFormat, tools: Sequence[ToolSpec], drop: int = 0) -> str:
    return " | ".join(_call_rule(tool_format, tool, drop) for tool in tools)


def _frame(tool_format: ToolFormat) -> tuple[str, str, str]:
    """(text before the first call, between two calls, after the last), trigger included."""
    after = "".join(tool_format.after_call)
    head = ("" if tool_format.keeps_trigger else tool_format.trigger) \
        + "".join(tool_format.opener)
    return head, after + "".join(tool_format.between), after + "".join(tool_format.closer)


def _call_rule(tool_format: ToolFormat, tool: ToolSpec, drop: int = 0) -> str:
    """One call of `tool`: its fixed text around the arguments (the first `drop` characters,
    already matched by the trigger, left out)."""
    before, after = tool_format.write_call(tool.name, _PLACEHOLDER).split(_PLACEHOLDER)
    own = tool.parameters.get("x-guidance")
    options = {**ARGUMENT_JSON_OPTIONS, **(own if isinstance(own, dict) else {})}
    schema = {**tool.parameters, "x-guidance": options}
    return f"{_lit(before[drop:])} %json {json.dumps(schema)} {_lit(after)}".strip()


def _lit(text: str) -> str:
    """A Lark string literal ("" writes nothing)."""
    return json.dumps(text) if text else ""
