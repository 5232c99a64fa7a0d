"""The /v1/responses request as served (stateless): fields, types and defaults.

`input` items are kept as plain objects here and checked one by one where they are
translated (translate.py), so a bad item is named by its index and field. Fields of stored
conversations (previous_response_id, conversation, background) are accepted only empty.
Owns: the request's shape. Does not own: its meaning (translate.py).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from justapi.frontend.openai_models import RequestModel

EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class FunctionTool(RequestModel):
    """A function the model may call (the Responses API's flat shape)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None
    """Accepted and ignored."""


class ReasoningConfig(RequestModel):
    effort: EFFORTS | None = None
    """Passed to the chat template (reasoning_effort; "none" switches Qwen3's thinking off)."""
    summary: str | None = None
    """Accepted; the thinking is returned whole, as reasoning_text, never summarized."""


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    """A system message before the input."""
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    """Accepted; nothing is stored (the server is stateless)."""
    metadata: dict[str, str] | None = None
    """Echoed in the response."""
    user: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    # sampling and template extras, as on chat (vLLM accepts them here too)
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None
