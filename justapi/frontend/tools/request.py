"""A chat request's `tools` and `tool_choice` -> a checked plan: which tools, which choice.

tool_choice none (or no tools): no calls are parsed or constrained; auto (the default with
tools): text or calls, a call constrained once started; required: at least one call;
a named function: one call of that tool. parallel_tool_calls false allows one call. Each
tool's parameters compile exactly when the tool says `"strict": true`, best effort otherwise
(justapi/structured/schema_plan.py). Owns: those rules, the tool definitions' checks and the
plan's output rules. Does not own: the grammar text (grammar.py), the prompt (render.py), the
parse (parser.py) or the reply's watch (watch.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from typing import Any

from justapi.frontend.choices import OutputRules
from justapi.frontend.constraints import Constraint, check
from justapi.frontend.errors import ApiError
from justapi.frontend.openai_models import ChatCompletionRequest, ToolDefinition
from justapi.frontend.structured_replies import StructuredMetrics
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.frontend.tools.formats import ToolFormat
from justapi.frontend.tools.grammar import ToolSpec, tool_call_lark
from justapi.frontend.tools.watch import ToolCallWatch, ToolSchema
from justapi.sampling import StructuredOutput
from justapi.structured.schema_plan import SchemaPlan, plan_schema

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
    """The tools a call may name (a named tool_choice: that one only), as they compile."""
    schemas: dict[str, ToolSchema]
    """Every tool's own parameters (calls are judged against them), by name."""
    is_required: bool
    """required or a named tool: the reply is calls only."""
    is_parallel: bool
    """More than one call may be made."""
    approximated: tuple[str, ...] = ()
    """Keywords of the tools' schemas compiled best effort as a closer form."""


def tool_plan(request: ChatCompletionRequest, tool_format: ToolFormat) -> ToolPlan | None:
    """None when no call is to be made (no tools, or tool_choice none)."""
    if len(request.tools or []) > MAX_TOOLS:
        raise ApiError(f"at most {MAX_TOOLS} tools, got {len(request.tools or [])}",
                       param="tools")
    planned = [_tool_spec(tool, index) for index, tool in enumerate(request.tools or [])]
    tools = [spec for spec, _, _ in planned]
    choice = request.tool_choice
    if len({tool.name for tool in tools}) != len(tools):
        raise ApiError("two tools have the same name", param="tools")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    schemas = {spec.name: schema for spec, schema, _ in planned}
    approximated = tuple(sorted({k for _, _, plan in planned for k in plan.approximated}))
    if choice is None or isinstance(choice, str):
        return ToolPlan(tool_format, tuple(tools), schemas, choice == "required",
                        request.parallel_tool_calls, approximated)
    named = [tool for tool in tools if tool.name == choice.function.name]
    if not named:
        raise ApiError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                       param="tool_choice.function.name")
    return ToolPlan(tool_format, tuple(named), schemas, True, False, approximated)


def _tool_spec(tool: ToolDefinition, index: int) -> tuple[ToolSpec, ToolSchema, SchemaPlan]:
    """The tool as it compiles, its own schema, and the plan between them (an unsupported
    strict schema is a 400 naming its field)."""
    function = tool.function
    if not TOOL_NAME.fullmatch(function.name):
        raise ApiError(f"tools[{index}].function.name must be 1 to 64 letters, digits, _ or -, "
                       f"got {function.name!r}", param=f"tools.{index}.function.name")
    parameters = function.parameters if function.parameters is not None else NO_ARGUMENTS
    param = f"tools.{index}.function.parameters"
    if parameters.get("type", "object") != "object":
        raise ApiError(f"tools[{index}].function.parameters must describe an object",
                       param=param)
    is_strict = bool(function.strict)
    try:
        plan = plan_schema(parameters, strict=is_strict)
    except ValueError as exc:
        raise ApiError(f"{param}: {exc}", param=param) from None
    own = ToolSchema(json.dumps(parameters, ensure_ascii=False), is_strict)
    return ToolSpec(function.name, plan.schema), own, plan


def tool_constraint(plan: ToolPlan, tokenizer: Tokenizer) -> Constraint:
    """The checked grammar of the plan's calls (each tool's schema was planned alone, so an
    unsupported one was named by its field)."""
    lark = tool_call_lark(plan.tool_format, plan.tools, is_required=plan.is_required,
                          is_parallel=plan.is_parallel,
                          special_ids=special_ids(tokenizer, plan.tool_format.markers))
    constraint = Constraint(StructuredOutput(kind="lark", spec=lark), "tools",
                            approximated=plan.approximated)
    check(constraint)
    return constraint


def tool_output_rules(plan: ToolPlan, tokenizer: Tokenizer,
                      metrics: StructuredMetrics | None) -> OutputRules:
    """The reply's grammar, how its text shows (special-token markers kept) and its watch
    (a repeated call ends it; calls are judged at the end)."""
    constraint = tool_constraint(plan, tokenizer)
    if metrics is not None:
        metrics.count_approximated(plan.approximated)
    markers = special_ids(tokenizer, plan.tool_format.markers)
    watch = partial(ToolCallWatch, plan.tool_format, plan.schemas, metrics, plan.is_required)
    return OutputRules(constraint.structured, show_special_tokens=bool(markers),
                       param="tools", approximated=plan.approximated, watch=watch)


def special_ids(tokenizer: Tokenizer, texts: tuple[str, ...]) -> dict[str, int]:
    """The texts that are special tokens of the vocabulary, with their ids."""
    found = {text: special_token_id(tokenizer, text) for text in texts}
    return {text: token_id for text, token_id in found.items() if token_id is not None}


def special_token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of the special token spelled `text` (None: no such token, or a plain one)."""
    token_id = tokenizer.token_to_id(text)
    if token_id is None or tokenizer.decode([token_id], skip_special_tokens=True):
        return None
    return token_id
