"""OpenAI-compatible request and response models (pydantic), as served and documented.

Requests are validated strictly (a string where a number belongs is a 400, not a guess);
range checks of sampling values are left to `SamplingParams`, the one place that defines
them. Response models describe what the routes return (and /openapi.json); the hot path
builds plain dicts of the same shape and serializes them with orjson.
Owns: field names, types and defaults of the HTTP API. Does not own: their meaning (serving).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 32
CHAT_ROLES = ("system", "user", "assistant", "tool")


class RequestModel(BaseModel):
    """Strict types; unknown fields (other vendors' extensions) are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False
    """Send a last chunk with `usage` (and `choices: []`) before `data: [DONE]`."""


class JsonSchemaFormat(RequestModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON Schema the reply must validate against (omitted: any JSON object)."""
    strict: bool | None = None
    """true: every keyword is enforced exactly, one that cannot be is a 400; otherwise best
    effort (approximated keywords are reported: docs/structured-outputs.md)."""


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """llama-server's spelling: the schema beside the type (json_object or json_schema)."""


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` extra field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """EBNF/GBNF (llama.cpp's) or llguidance's Lark."""
    json_object: bool | None = None
    structural_tag: Any = None
    """Not supported: a value is refused."""


class OutputConstraintFields(RequestModel):
    """Constraints on the output's text, as OpenAI, vLLM, llama-server and SGLang spell
    them; at most one per request (justapi/frontend/constraints.py)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    """vLLM's."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older spellings of structured_outputs (removed there in v0.12)."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | str | None = None
    """llama-server's (an object) and SGLang's (JSON text)."""
    grammar: str | None = None
    """llama-server's GBNF grammar."""
    regex: str | None = None
    """SGLang's."""
    ebnf: str | None = None
    """SGLang's (xgrammar's EBNF, GBNF-like)."""


class GenerationFields(OutputConstraintFields):
    """What completions and chat completions share: model, sampling, stopping, streaming."""

    model: str | None = None
    """The served model name (see /v1/models); omitted means the served model."""
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    """With n > 1, choice i samples with a seed derived from (seed, i)."""
    stop: str | list[str] | None = None
    """Matched across token boundaries, never part of the output."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and ignored."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> bias in [-100, 100], added to that token's logit."""
    priority: int = 0
    """vLLM's: with --scheduling-policy priority, lower is served sooner (and may preempt
    running requests of a higher value); any other value than 0 is refused otherwise."""


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    """Text, token ids, or a batch of either (choices are numbered prompt-major)."""
    max_tokens: int | None = 16
    logprobs: int | None = None
    """Log-probabilities of the sampled token and of the `logprobs` most likely ones."""
    echo: bool = False
    """Prefix each choice's text with its prompt."""
    suffix: str | None = None
    """Not supported: a value is refused."""
    best_of: int | None = None
    """Only best_of == n (the default) is supported."""


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class CalledFunction(RequestModel):
    name: str
    arguments: str | dict[str, Any]
    """JSON text (OpenAI's); an object is accepted too."""


class MessageToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    """tool messages: the call this is the result of."""
    tool_calls: list[MessageToolCall] | None = None
    """assistant messages: the calls it made."""
    reasoning_content: str | None = None
    """assistant messages: their thinking, as replies return it (templates that show past
    thinking render it)."""
    reasoning: str | None = None
    """vLLM's newer name of reasoning_content."""


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema of the arguments object (omitted: no arguments)."""
    strict: bool | None = None
    """true: `parameters` compiles exactly or is a 400; otherwise best effort."""


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens; both are accepted."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    """Render the template's assistant header after the messages (vLLM's extension)."""
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: auto with tools, none without."""
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template, e.g. {"enable_thinking": false} (vLLM's,
    llama-server's)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """Passed to the template as `reasoning_effort`; "none" also switches thinking off where
    the template has Qwen3's `enable_thinking`."""


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: exactly one of `prompt` (text) or `messages` (rendered as for chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    """With messages: rendered as for a chat request that may call them."""
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    """Default: True for a prompt (BOS as the model asks), False for messages (the
    template writes it)."""
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """With messages: extra variables for the chat template, as on chat."""


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------ responses


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int
    """Tokens spent thinking, the end-of-thinking marker included."""


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    """Where a reasoning parser is active."""


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    """Always set on a full response; on a stream only in the include_usage chunk."""


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None


class ResponseFunction(ResponseModel):
    name: str
    arguments: str


class ResponseToolCall(ResponseModel):
    id: str
    type: Literal["function"]
    function: ResponseFunction


class AssistantMessage(ResponseModel):
    role: Literal["assistant"]
    content: str
    reasoning_content: str | None = None
    """A reasoning model's thinking (None: it did not think); only where a reasoning parser
    is active."""
    reasoning: str | None = None
    """The same text under vLLM's newer name."""


class AssistantToolCallsMessage(ResponseModel):
    """A reply that called tools (a request with tools)."""

    role: Literal["assistant"]
    content: str | None
    """Text before the calls; None when there is none."""
    tool_calls: list[ResponseToolCall]
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage | AssistantToolCallsMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort", "error"] | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(ResponseModel):
    name: str | None = None
    arguments: str


class DeltaToolCall(ResponseModel):
    """A call's first delta has id, type and function.name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort", "error"] | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class SamplingDefaultsCard(ResponseModel):
    """What the sampling fields a request leaves out get, and where each value comes from."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    source: dict[str, Literal["config", "gguf", "builtin"]]
    """Per field: config (a flag or TOML key), gguf (the model's general.sampling.*) or
    builtin (llama-server's defaults)."""


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    sampling_defaults: SamplingDefaultsCard


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class ErrorDetail(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorDetail


class HealthWorker(ResponseModel):
    worker_id: int
    pool_id: int
    healthy: bool
    draining: bool = False
    reason: str = ""
    role: str = "mixed"  # PD (--pd P:D): prefill | decode
    host: str = ""  # --launcher ray: the host it runs on ("" = this host)


class HealthHost(ResponseModel):
    """--launcher ray: one host's workers."""

    host: str
    num_workers: int
    num_workers_healthy: int


class HealthResponse(ResponseModel):
    """/health: 200 "ok" or "degraded" (warnings: e.g. one of two workers down), else 503."""

    status: Literal["ok", "degraded", "unhealthy"]
    problems: list[str] = []
    warnings: list[str] = []
    workers: list[HealthWorker] = []
    hosts: list[HealthHost] = []
    scheduler_pid: int = 0
    """The scheduler process serving now (0: not known yet)."""
    scheduler_restarts: int = 0
    """Schedulers that took the open requests over after the one before died."""
