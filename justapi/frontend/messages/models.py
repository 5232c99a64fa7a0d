"""The /v1/messages request (Anthropic's Messages API) as served: fields, types and defaults.

`messages` and `system` are kept as plain objects and checked block by block where they are
translated (translate.py), so a bad block is named by its place. Owns: the request's shape.
Does not own: its meaning.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from justapi.frontend.openai_models import RequestModel


class Tool(RequestModel):
    """A client tool: its name, what it does, and the JSON Schema of its input."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None
    """None or "custom"; Anthropic's server tools (web search...) are not served."""


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """type "tool": the tool to call."""
    disable_parallel_tool_use: bool = False


class Thinking(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    """Accepted; thinking is not cut at a budget (max_tokens bounds the whole reply)."""


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(RequestModel):
    """/v1/messages/count_tokens: what the prompt of such a request would be."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """Accepted and ignored."""
