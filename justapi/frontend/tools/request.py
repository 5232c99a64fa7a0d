"""A chat request's `tools` and `tool_choice` -> a checked plan: which tools, which choice.

tool_choice none (or no tools): no calls are parsed or constrained; auto (the default with
tools): text or calls, a call constrained once started; required: at least one call;
a named function: one call of that tool. parallel_tool_calls false allows one call.
Owns: those rules, the tool definitions' checks and the plan's checked constraint. Does not
own: the grammar text (grammar.py), the prompt (render.py) or the parse (parser.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from justapi.frontend.constraints import Constraint, check
from justapi.frontend.errors import ApiError
from justapi.frontend.openai_models import ChatCompletionRequest, ToolDefinition
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.frontend.tools.formats import ToolFormat
from justapi.frontend.tools.grammar import ToolSpec, tool_call_lark
from justapi.sampling import StructuredOutput

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""OpenAI's rule for function names."""
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {},
                                "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request calls tools."""

    tool_format: ToolFormat
    tools: tuple[ToolSpec, ...]
    """The tools a call may name (a named tool_choice: that one only)."""
    is_required: bool
    """required or a named tool: the reply is calls only."""
    is_parallel: bool
    """More than one call may be made."""


def tool_plan(request: ChatCompletionRequest, tool_format: ToolFormat) -> ToolPlan | None:
    """None when no call is to be made (no tools, or tool_choice none)."""
    tools = [_tool_spec(tool, index) for index, tool in enumerate(request.tools or [])]
    choice = request.tool_choice
    if len(tools) > MAX_TOOLS:
        raise ApiError(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    if len({tool.name for tool in tools}) != len(tools):
        raise ApiError("two tools have the same name", param="tools")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    if choice is None or isinstance(choice, str):
        return ToolPlan(tool_format, tuple(tools), choice == "required",
                        request.parallel_tool_calls)
    named = [tool for tool in tools if tool.name == choice.function.name]
    if not named:
        raise ApiError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                       param="tool_choice.function.name")
    return ToolPlan(tool_format, tuple(named), True, False)


def _tool_spec(tool: ToolDefinition, index: int) -> ToolSpec:
    function = tool.function
    if not TOOL_NAME.fullmatch(function.name):
        raise ApiError(f"tools[{index}].function.name must be 1 to 64 letters, digits, _ or -, "
                       f"got {function.name!r}", param=f"tools.{index}.function.name")
    parameters = function.parameters if function.parameters is not None else NO_ARGUMENTS
    if parameters.get("type", "object") != "object":
        raise ApiError(f"tools[{index}].function.parameters must describe an object",
                       param=f"tools.{index}.function.parameters")
    return ToolSpec(function.name, parameters)


def tool_constraint(plan: ToolPlan, tokenizer: Tokenizer) -> Constraint:
    """The checked grammar of the plan's calls; each tool's schema is checked alone first, so
    an unsupported one is named by its field."""
    for index, tool in enumerate(plan.tools):
        schema = json.dumps(tool.parameters, ensure_ascii=False)
        check(Constraint(StructuredOutput(kind="json_schema", spec=schema),
                         f"tools.{index}.function.parameters"))
    lark = tool_call_lark(plan.tool_format, plan.tools, is_required=plan.is_required,
                          is_parallel=plan.is_parallel,
                          trigger_token_id=special_token_id(tokenizer, plan.tool_format.trigger))
    constraint = Constraint(StructuredOutput(kind="lark", spec=lark), "tools")
    check(constraint)
    return constraint


def special_token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of the special token spelled `text` (None: no such token, or a plain one)."""
    token_id = tokenizer.token_to_id(text)
    if token_id is None or tokenizer.decode([token_id], skip_special_tokens=True):
        return None
    return token_id
