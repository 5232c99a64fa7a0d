"""An Anthropic /v1/messages request -> the chat request it means (the one request path).

`system` (text or text blocks) becomes a system message. A user turn's `tool_result` blocks
become tool messages (before its text, which stays a user message); an assistant turn's
`text` blocks its content, `tool_use` blocks its tool calls (input -> arguments JSON) and a
`thinking` block its reasoning_content. Tools (input_schema -> parameters), tool_choice (any ->
required, tool -> a named function, disable_parallel_tool_use -> parallel_tool_calls false),
stop_sequences, `thinking` (enabled / disabled -> the template's enable_thinking),
output_config.effort (-> reasoning_effort) and output_config.format (-> a JSON schema
response_format) map one to one. Images and documents are refused. Owns: that mapping and the
field names its errors speak. Does not own: what the chat request means.
"""
from __future__ import annotations

import json
from typing import Any

from justapi.frontend.errors import ApiError
from justapi.frontend.messages.models import CountTokensRequest, MessagesRequest
from justapi.frontend.openai_models import ChatCompletionRequest

RENAMES = (
    (r"\bmax_completion_tokens\b", "max_tokens"),
    (r"\bresponse_format(\.json_schema)?\.schema\b", "output_config.format.schema"),
    (r"\btools\.(\d+)\.function\.parameters\b", r"tools.\1.input_schema"),
    (r"\btools\.(\d+)\.function\.name\b", r"tools.\1.name"),
    (r"\btool_choice\.function\.name\b", "tool_choice.name"),
    (r"^stop\b", "stop_sequences"),
    (r"\breasoning_effort\b", "output_config.effort"),
)
"""Chat field names in errors -> this API's (errors.renamed)."""
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request means; ApiError naming this API's
    fields."""
    body: dict[str, Any] = {"model": request.model}
    body["messages"] = _system(request.system) + chat_messages(request.messages)
    if isinstance(request, MessagesRequest):
        body.update(max_completion_tokens=request.max_tokens, stop=request.stop_sequences,
                    temperature=request.temperature, top_p=request.top_p,
                    top_k=request.top_k, stream=request.stream)
    if request.tools:
        body["tools"] = [_tool(tool, index) for index, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        choice = request.tool_choice
        if choice.type == "tool":
            if not choice.name:
                raise ApiError("tool_choice of type tool needs a name", param="tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = CHOICES[choice.type]
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if request.thinking is not None and request.thinking.type != "adaptive":
        body["chat_template_kwargs"] = {"enable_thinking": request.thinking.type == "enabled"}
    config = request.output_config
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = EFFORTS[config.effort]
    if config is not None and config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": config.format.schema_}}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def chat_messages(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic turns as chat messages."""
    out: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        where = f"messages.{index}"
        role = turn.get("role")
        blocks = _blocks(turn.get("content"), f"{where}.content")
        if role == "user":
            out += _user_messages(blocks, f"{where}.content")
        elif role == "assistant":
            out.append(_assistant_message(blocks, f"{where}.content"))
        else:
            raise ApiError(f"{where}.role must be user or assistant, got {role!r}",
                           param=f"{where}.role")
    return out


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(
        _block_text(block, f"system.{i}") for i, block in enumerate(system))
    return [{"role": "system", "content": text}] if text else []


def _tool(tool: Any, index: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ApiError(f"tools.{index}: server tools ({tool.type!r}) are not served; give "
                       "client tools (name, description, input_schema)", param=f"tools.{index}")
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ApiError(f"{where} must be a string or a list of content blocks", param=where)
    return content


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Tool results first (they answer the calls before them), then the turn's text."""
    results, texts = [], []
    for index, block in enumerate(blocks):
        if block.get("type") == "tool_result":
            results.append(_tool_result(block, f"{where}.{index}"))
        else:
            texts.append(_block_text(block, f"{where}.{index}"))
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for index, block in enumerate(blocks):
        kind, place = block.get("type"), f"{where}.{index}"
        if kind == "tool_use":
            calls.append({"id": _string(block, "id", place), "type": "function", "function": {
                "name": _string(block, "name", place),
                "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", place))
        elif kind != "redacted_thinking":  # encrypted thinking of another model: dropped
            texts.append(_block_text(block, place))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_block_text(b, f"{where}.content.{i}") for i, b in enumerate(content))
    elif not isinstance(content, str):
        raise ApiError(f"{where}.content must be text or text blocks", param=f"{where}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
            "content": content}


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" \
            or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise ApiError(f"{where}: only text, tool_use, tool_result and thinking blocks are "
                       f"served, got {kind!r}", param=where)
    return str(block["text"])


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise ApiError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value
