"""The OpenAI-compatible HTTP API: FastAPI app factory, routes, error bodies, uvicorn server.

Routes: /v1/completions, /v1/chat/completions (SSE when stream=true), /v1/responses,
/v1/messages (+ /count_tokens; errors in Anthropic's shape there), /v1/embeddings,
/v1/models, /tokenize, /detokenize, /health, /metrics (and FastAPI's /openapi.json). Every refusal is an
OpenAI-style error body (validation errors are 400, like vLLM, not FastAPI's 422). A client
that disconnects, streaming or not, gets its scheduler requests aborted at once.
Owns: the HTTP surface. Does not own: request semantics (serving*.py, prompts.py, choices.py,
sse.py) or the process shell.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from justapi.frontend import metrics as metrics_module
from justapi.frontend.errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    SERVER_ERROR,
    ApiError,
    anthropic_error_body,
    from_validation_errors,
)
from justapi.frontend.embedding_models import EmbeddingRequest, EmbeddingResponse
from justapi.frontend.guards import DEFAULT_MAX_REQUEST_BYTES, HttpGuards
from justapi.frontend.openai_models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from justapi.frontend.messages.models import CountTokensRequest, MessagesRequest
from justapi.frontend.messages.output import count_tokens, create_message
from justapi.frontend.responses.models import ResponsesRequest
from justapi.frontend.responses.output import create_response
from justapi.frontend.serving import Serving
from justapi.frontend.serving_chat import chat_prompt, create_chat_completion
from justapi.frontend.serving_completions import create_completion
from justapi.frontend.serving_embeddings import create_embedding
from justapi.wire.protocol import SchedulerStats

logger = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request"; nobody reads it
ERRORS: dict[int | str, dict[str, Any]] = {400: {"model": ErrorResponse},
                                           500: {"model": ErrorResponse}}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MESSAGES_PATH = "/v1/messages"
"""Anthropic's routes: their errors take Anthropic's shape."""


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def build_app(serving: Serving, *, api_key: str = "",
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app over one Serving (engine link, tokenizer, template, metrics); with
    `api_key` every route but /health needs it (guards.py)."""
    app = FastAPI(title="JustAPI inference", version="0.1.0",
                  description="OpenAI-compatible completions and chat completions.")
    app.add_middleware(HttpGuards, api_key=api_key, max_request_bytes=max_request_bytes,
                       rejections=serving.admission.rejections)
    _add_error_handlers(app)
    _add_generation_routes(app, serving)
    _add_embedding_routes(app, serving)
    _add_model_routes(app, serving)
    _add_ops_routes(app, serving)
    return app


class HttpServer(uvicorn.Server):
    """uvicorn without its own SIGINT/SIGTERM handlers: the frontend process decides when to
    stop listening (after draining in-flight requests, justapi/frontend/lifecycle.py)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_http_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                     log_level: str = "info") -> uvicorn.Server:
    """uvicorn with httptools; `await server.serve()` in the frontend's (uvloop) event loop,
    set `server.should_exit = True` to stop it."""
    config = uvicorn.Config(app, host=host, port=port, http="httptools", loop="uvloop",
                            log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    return HttpServer(config)


# ------------------------------------------------------------------------ errors
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(request, from_validation_errors(exc.errors()))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return _error_response(request, ApiError(str(exc.detail), status=exc.status_code,
                                                 error_type=kind))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("internal error")
        return _error_response(request, ApiError(f"internal error: {type(exc).__name__}: {exc}",
                                                 status=500, error_type=SERVER_ERROR))


def _error_response(request: Request, error: ApiError) -> Response:
    """OpenAI's error body, or Anthropic's on its routes."""
    is_anthropic = request.url.path.startswith(MESSAGES_PATH)
    response = json_response(anthropic_error_body(error) if is_anthropic else error.body(),
                             error.status)
    response.headers.update(error.headers)
    return response


# ------------------------------------------------------------------------ generation
def _add_generation_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        headers: dict[str, str] = {}
        return await _respond(request, create_completion(serving, body, time.perf_counter(),
                                                         headers), headers)

    @app.post("/v1/chat/completions",
              responses={200: {"model": ChatCompletionResponse}, **ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        headers: dict[str, str] = {}
        return await _respond(request, create_chat_completion(serving, body,
                                                              time.perf_counter(), headers),
                              headers)

    @app.post("/v1/responses", responses=ERRORS)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _respond(request, create_response(serving, body, time.perf_counter()))

    @app.post(MESSAGES_PATH, responses=ERRORS)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await _respond(request, create_message(serving, body, time.perf_counter()))

    @app.post(f"{MESSAGES_PATH}/count_tokens", responses=ERRORS)
    async def count_message_tokens(body: CountTokensRequest) -> Response:
        return json_response(count_tokens(serving, body))


def _add_embedding_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **ERRORS})
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _respond(request, create_embedding(serving, body, time.perf_counter()))


async def _respond(request: Request, work: Awaitable[dict | AsyncIterator[bytes]],
                   headers: dict[str, str] | None = None) -> Response:
    """Run a handler while watching for the client going away: a disconnect cancels the work
    (whose cleanup aborts its scheduler requests). A stream is handed to StreamingResponse,
    whose own disconnect watch cancels it the same way. `headers`: the handler's own, set by
    the time it returns."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():  # the client left first
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=CLIENT_CLOSED_STATUS)
    result = task.result()
    if isinstance(result, dict):
        response = json_response(result)
        response.headers.update(headers or {})
        return response
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={**SSE_HEADERS, **(headers or {})})


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ------------------------------------------------------------------------ model & tokens
def _add_model_routes(app: FastAPI, serving: Serving) -> None:
    created = int(time.time())
    config = serving.config

    @app.get("/v1/models", responses={200: {"model": ModelList}})
    async def models() -> Response:
        card = {"id": config.model_name, "object": "model", "created": created,
                "owned_by": "justapi", "root": config.model_name,
                "max_model_len": config.max_context,
                "sampling_defaults": {**config.sampling_defaults.values,
                                      "source": config.sampling_defaults.sources}}
        return json_response({"object": "list", "data": [card]})

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **ERRORS})
    async def tokenize(body: TokenizeRequest) -> Response:
        serving.check_model(body.model)
        token_ids = _tokenize(serving, body)
        payload: dict[str, Any] = {"count": len(token_ids), "max_model_len": config.max_context,
                                   "tokens": token_ids, "token_strs": None}
        if body.return_token_strs:
            payload["token_strs"] = [serving.tokenizer.id_to_token(t) for t in token_ids]
        return json_response(payload)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **ERRORS})
    async def detokenize(body: DetokenizeRequest) -> Response:
        serving.check_model(body.model)
        token_ids = serving.prompts.check_token_ids(body.tokens, "tokens")
        text = serving.tokenizer.decode(token_ids, skip_special_tokens=False)
        return json_response({"prompt": text})


def _tokenize(serving: Serving, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError("pass exactly one of prompt and messages", param="prompt")
    prompts = serving.prompts
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return prompts.encode_text(body.prompt, add_special)
    assert body.messages is not None
    variables = serving.reasoning.template_variables(body.chat_template_kwargs, None)
    prompt = chat_prompt(serving, body.messages, body.tools, body.add_generation_prompt,
                         describe_tools=bool(body.tools), variables=variables)
    if body.add_special_tokens:  # the template's text tokenized with BOS as the model asks
        assert prompt.text is not None
        return prompts.encode_text(prompt.text, True)
    return prompt.token_ids


# ------------------------------------------------------------------------ operations
def _add_ops_routes(app: FastAPI, serving: Serving) -> None:
    @app.get("/health", responses={200: {"model": HealthResponse},
                                   503: {"model": HealthResponse}})
    async def health() -> Response:
        problems = serving.engine.health_problems()
        if serving.admission.is_draining:  # take this instance out of the load balancer
            problems = ["the server is shutting down (draining)", *problems]
        details = _health_details(serving.engine.stats)
        details.update(scheduler_pid=serving.engine.scheduler_pid,
                       scheduler_restarts=serving.engine.num_restarts)
        if problems:
            return json_response({"status": "unhealthy", "problems": problems, **details}, 503)
        status = "degraded" if details["warnings"] else "ok"
        return json_response({"status": status, "problems": [], **details})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=metrics_module.CONTENT_TYPE)


def _health_details(stats: SchedulerStats | None) -> dict[str, Any]:
    """The scheduler's warnings and each worker's verdict, from its latest snapshot."""
    if stats is None:
        return {"warnings": [], "workers": []}
    workers = [{"worker_id": int(w["worker_id"]), "pool_id": int(w.get("pool_id", 0)),
                "healthy": bool(w.get("healthy")), "draining": bool(w.get("draining")),
                "reason": str(w.get("reason", "")), "role": str(w.get("role", "mixed")),
                "host": str(w.get("host", ""))}
               for w in stats.workers if isinstance(w, dict) and "worker_id" in w]
    details: dict[str, Any] = {"warnings": [str(x) for x in stats.warnings], "workers": workers}
    if any(w["host"] for w in workers):  # --launcher ray: workers on several hosts
        details["hosts"] = _hosts(workers)
    return details


def _hosts(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for worker in workers:
        row = out.setdefault(worker["host"], {"host": worker["host"], "num_workers": 0,
                                              "num_workers_healthy": 0})
        row["num_workers"] += 1
        row["num_workers_healthy"] += int(worker["healthy"])
    return [out[host] for host in sorted(out)]
