"""/v1/embeddings request and response shapes (OpenAI's, with vLLM's extra fields).

Owns: field types, limits and their documentation. Does not own: the semantics
(serving_embeddings.py).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from justapi.frontend.openai_models import RequestModel, ResponseModel

MAX_INPUTS = 2048
"""Inputs in one request (OpenAI's limit)."""


class EmbeddingRequest(RequestModel):
    input: str | list[str] | list[int] | list[list[int]]
    """Text, token ids, or a batch of either (one embedding per input, in order)."""
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each embedding's float32 little-endian bytes, base64-encoded (what the openai
    client asks for by default and decodes itself)."""
    dimensions: int | None = Field(None, ge=1)
    """Matryoshka models only: keep the leading dimensions, then renormalize."""
    user: str | None = None
    """Accepted and ignored."""
    priority: int = 0
    """vLLM's: with --scheduling-policy priority, lower is served sooner."""
    add_special_tokens: bool = True
    """vLLM's: tokenize text inputs with the model's BOS/EOS as its GGUF asks."""


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
