"""/v1/embeddings: inputs -> pooling requests through the one request path -> vectors.

Each input (text tokenized with the model's special tokens, or token ids) becomes one
scheduler request with the server's pooling (SubmitRequest.pooling), batched by the scheduler
with everything else; its pooled hidden state comes back in the last delta. Here it is cut
to `dimensions` (Matryoshka models; else only the full size is accepted) and L2-normalized,
as vLLM, llama-server and the models' own references do, then written as floats or base64.
Owns: the embeddings response and its checks. Does not own: pooling (workers/pooling.py),
the request stream (EngineClient).
"""
from __future__ import annotations

import asyncio
import base64

import numpy as np

from justapi.frontend.embedding_models import MAX_INPUTS, EmbeddingRequest
from justapi.frontend.engine_client import RequestStream
from justapi.frontend.errors import ApiError
from justapi.frontend.prompts import Prompt
from justapi.frontend.serving import Serving
from justapi.wire.protocol import FINISH_ABORT, FINISH_STOP


async def create_embedding(serving: Serving, request: EmbeddingRequest,
                           arrival_s: float) -> dict:
    serving.check_model(request.model)
    if not serving.config.pooling:
        raise ApiError("this model serves no embeddings: its GGUF has no pooling_type; start "
                       "the server with --pooling last|mean|cls", param="model")
    size = _output_size(serving, request.dimensions)
    prompts = _prompts(serving, request)
    priority = serving.check_priority(request.priority)
    serving.check_available(len(prompts))
    started = [serving.start_pooling(p.token_ids, arrival_s, priority) for p in prompts]
    try:
        vectors = await asyncio.gather(*(_pooled(serving, stream) for stream, _ in started))
    finally:
        for stream, timer in started:
            if not stream.finished:
                serving.engine.abort(stream.request_id)
                timer.on_finish(FINISH_ABORT)
            else:
                timer.on_finish(FINISH_STOP)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v[:size], request)}
            for i, v in enumerate(vectors)]
    num_tokens = sum(len(p.token_ids) for p in prompts)
    return {"object": "list", "data": data, "model": serving.config.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _output_size(serving: Serving, dimensions: int | None) -> int:
    full = serving.config.hidden_size
    if dimensions is None or dimensions == full:
        return full
    if not serving.config.is_matryoshka:
        raise ApiError(f"dimensions {dimensions}: this model is not Matryoshka-trained, only "
                       f"its full size {full} is served (start with --matryoshka on to allow "
                       "others)", param="dimensions")
    if dimensions > full:
        raise ApiError(f"dimensions {dimensions} is more than the model's {full}",
                       param="dimensions")
    return dimensions


def _prompts(serving: Serving, request: EmbeddingRequest) -> list[Prompt]:
    prompts = serving.prompts
    inputs: list[str] | list[list[int]]
    if isinstance(request.input, str):
        inputs = [request.input]
    elif request.input and isinstance(request.input[0], int):
        inputs = [request.input]  # type: ignore[list-item]
    else:
        inputs = request.input  # type: ignore[assignment]
    if not inputs:
        raise ApiError("input is empty", param="input")
    if len(inputs) > MAX_INPUTS:
        raise ApiError(f"at most {MAX_INPUTS} inputs, got {len(inputs)}", param="input")
    out = []
    for item in inputs:
        if isinstance(item, str):
            ids = prompts.encode_text(item, request.add_special_tokens, "input")
            out.append(Prompt(ids, item))
        else:
            out.append(Prompt(prompts.check_token_ids(item, "input")))
    for prompt in out:
        if not prompt.token_ids:
            raise ApiError("an input is empty", param="input")
        if len(prompt.token_ids) > serving.config.max_context:
            raise ApiError(f"an input has {len(prompt.token_ids)} tokens; this model's context "
                           f"length is {serving.config.max_context}", param="input",
                           code="context_length_exceeded")
    return out


async def _pooled(serving: Serving, stream: RequestStream) -> np.ndarray:
    async for delta in stream:
        if delta.embedding is not None:
            return delta.embedding
        if delta.finish_reason:
            raise serving.generation_failed(delta.error or f"finished with "
                                            f"{delta.finish_reason!r} and no embedding")
    raise serving.generation_failed("no embedding")


def _encode(vector: np.ndarray, request: EmbeddingRequest) -> list[float] | str:
    """L2-normalized (after any Matryoshka cut), as floats or base64 float32 bytes."""
    vector = vector.astype(np.float64)
    norm = float(np.linalg.norm(vector))
    unit = (vector / norm if norm > 0 else vector).astype(np.float32)
    if request.encoding_format == "base64":
        return base64.b64encode(unit.astype("<f4").tobytes()).decode("ascii")
    return unit.tolist()


