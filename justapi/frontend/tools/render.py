"""Messages and tools as the chat template takes them, when tools or past calls are in play.

A template of a known family renders tools and calls itself: it gets `tools` (OpenAI's
definitions, as HF's apply_chat_template passes them) and past calls with their arguments as
objects (HF's convention; OpenAI sends JSON text). A template of no known family (SmolLM2's)
gets what llama.cpp's generic handler gives it: a system message describing the tools and the
reply format (GENERIC_TOOL_PROMPT), past calls written as that format into the assistant's
content, and tool results as user messages {"tool_response": {"tool", "tool_call_id",
"content"}}. Owns: those rewrites. Does not own: the template (text/chat_template.py).
"""
from __future__ import annotations

import json
from typing import Any

from justapi.frontend.tools.formats import GENERIC, ToolFormat

GENERIC_TOOL_PROMPT = (
    "You can call the following tools:\n{tools}\n\n"
    "To call tools, reply with only a JSON object of this form, one entry per call:\n"
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}\n'
    "Otherwise reply to the user as usual.")
"""The generic format's instructions; {tools} is a JSON list of {name, description,
parameters}, one tool per line."""


def chat_inputs(messages: list[dict], tools: list[dict] | None, tool_format: ToolFormat,
                describe_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the template. describe_tools: the model may call (tool_choice
    is not none), so a generic template gets the tools described."""
    if tool_format is not GENERIC:
        return [_with_argument_objects(message) for message in messages], tools or None
    names = _call_names(messages)
    out = [_generic_message(message, names) for message in messages]
    if tools and describe_tools:
        out = _with_system_text(out, GENERIC_TOOL_PROMPT.format(tools=_tool_lines(tools)))
    return out, None


def _with_argument_objects(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function", {})
        arguments = _arguments_object(function.get("arguments"))
        out.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": out}


def _arguments_object(arguments: Any) -> Any:
    """JSON text of an object -> the object; anything else as it is."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _generic_message(message: dict, names: dict[str, str]) -> dict:
    role = message["role"]
    if role == "assistant" and message.get("tool_calls"):
        calls = [(c["function"]["name"], _arguments_text(c["function"].get("arguments")))
                 for c in message["tool_calls"]]
        content = _text(message.get("content"))
        written = GENERIC.write_calls(calls)
        return {"role": "assistant", "content": f"{content}\n{written}" if content else written}
    if role == "tool":
        call_id = message.get("tool_call_id")
        response = {"tool": message.get("name") or names.get(call_id or "", ""),
                    "tool_call_id": call_id, "content": _text(message.get("content"))}
        return {"role": "user", "content": json.dumps({"tool_response": response},
                                                      ensure_ascii=False)}
    return message


def _arguments_text(arguments: Any) -> str:
    """Arguments as the generic format writes them (json.dumps' separators)."""
    value = _arguments_object(arguments)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else str(value)


def _text(content: Any) -> str:
    """Content as a string (text parts joined, as the template validation does)."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _call_names(messages: list[dict]) -> dict[str, str]:
    """tool_call_id -> function name, from the assistant messages' calls."""
    return {call["id"]: call["function"]["name"] for message in messages
            for call in message.get("tool_calls") or [] if "id" in call}


def _tool_lines(tools: list[dict]) -> str:
    entries = []
    for tool in tools:
        function = tool.get("function", {})
        entry = {"name": function.get("name"), "description": function.get("description"),
                 "parameters": function.get("parameters")}
        entries.append(json.dumps({k: v for k, v in entry.items() if v is not None},
                                  ensure_ascii=False))
    return "[" + ",\n".join(entries) + "]"


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = _text(first.get("content"))
        return [{**first, "content": f"{content}\n\n{text}" if content else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
