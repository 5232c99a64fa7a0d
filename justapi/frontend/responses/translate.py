"""A /v1/responses request -> the chat request it means (the one request path, serving_chat).

`instructions` become a system message; `input` text a user message; input items become chat
messages: messages (developer -> system; input_text / output_text parts joined), a model's
past `function_call` items join the assistant turn they follow as its tool calls, a
`function_call_output` becomes a tool message, and a past `reasoning` item becomes the next
assistant turn's reasoning_content. Tools, tool_choice, `text.format` (-> response_format),
`reasoning.effort` (-> reasoning_effort) and `max_output_tokens` map one to one. Anything that
needs stored state (previous_response_id, item references) is a 400. Owns: that mapping and the
field names its errors speak. Does not own: what the chat request means.
"""
from __future__ import annotations

from typing import Any

from justapi.frontend.errors import ApiError
from justapi.frontend.openai_models import ChatCompletionRequest
from justapi.frontend.responses.models import ResponsesRequest

RENAMES = (
    (r"^messages\b", "input"),
    (r"\bmax_completion_tokens\b", "max_output_tokens"),
    (r"\bresponse_format(\.json_schema)?\.schema\b", "text.format.schema"),
    (r"\bresponse_format\b", "text.format"),
    (r"\btools\.(\d+)\.function\.", r"tools.\1."),
    (r"\btool_choice\.function\.", "tool_choice."),
    (r"\breasoning_effort\b", "reasoning.effort"),
)
"""Chat field names in errors -> this API's (errors.renamed)."""
PASSED_AS_IS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                "presence_penalty", "frequency_penalty", "repetition_penalty",
                "chat_template_kwargs", "parallel_tool_calls", "stream", "user")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request means; ApiError naming this API's fields."""
    _check_stateless(request)
    body: dict[str, Any] = {name: getattr(request, name) for name in PASSED_AS_IS}
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body["messages"] = system + input_messages(request.input)
    body["max_completion_tokens"] = request.max_output_tokens
    body["reasoning_effort"] = request.reasoning.effort if request.reasoning else None
    body["response_format"] = _response_format(request)
    if request.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in request.tools]
    choice = request.tool_choice
    body["tool_choice"] = choice if isinstance(choice, str) or choice is None \
        else {"type": "function", "function": {"name": choice.name}}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise ApiError("input is empty", param="input")
    messages: list[dict[str, Any]] = []
    thinking: str | None = None  # a past reasoning item, for the next assistant turn
    names: dict[str, str] = {}  # call_id -> function name
    for index, item in enumerate(items):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "reasoning":
            thinking = _reasoning_text(item, where)
            continue
        if kind == "message":
            message = _message(item, where)
        elif kind == "function_call":
            message = _with_call(messages, item, where, names)
        elif kind == "function_call_output":
            message = _call_output(item, where, names)
        else:
            raise ApiError(f"{where}.type {kind!r} is not supported (this server is stateless "
                           "and serves text: send messages, function calls and their outputs)",
                           param=f"{where}.type")
        if message["role"] == "assistant" and thinking is not None:
            message["reasoning_content"] = thinking
            thinking = None
        if not messages or message is not messages[-1]:
            messages.append(message)
    return messages


def _check_stateless(request: ResponsesRequest) -> None:
    for name in ("previous_response_id", "conversation"):
        if getattr(request, name) is not None:
            raise ApiError(f"{name} is not supported: this server stores no responses; send "
                           "the whole conversation in input", param=name)
    if request.background:
        raise ApiError("background responses are not supported", param="background")


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = request.text.format if request.text else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.name, "schema": text_format.schema_,
              "description": text_format.description, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                       param=f"{where}.role")
    return {"role": ROLES[role], "content": _text(item.get("content"), f"{where}.content")}


def _with_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str,
               names: dict[str, str]) -> dict[str, Any]:
    """The assistant turn a function_call belongs to: the one just before it, or a new one."""
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    names[call_id] = name
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": _string(item, "arguments", where)}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return last
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _call_output(item: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    call_id = _string(item, "call_id", where)
    message = {"role": "tool", "tool_call_id": call_id,
               "content": _text(item.get("output"), f"{where}.output")}
    if call_id in names:
        message["name"] = names[call_id]
    return message


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise ApiError(f"{where}.content must be a list of reasoning_text parts",
                       param=f"{where}.content")
    return "".join(part.get("text", "") for part in parts if isinstance(part, dict))


def _text(content: Any, where: str) -> str:
    """Content as text: a string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise ApiError(f"{where}.{index}: only text parts are served (input_text, "
                           f"output_text), got {kind!r}", param=f"{where}.{index}")
        texts.append(part.get("text", part.get("refusal")))
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value
