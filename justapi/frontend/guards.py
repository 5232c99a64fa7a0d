"""HTTP guards in front of every route: the API key and the request body size limit.

A pure ASGI middleware (it sees every request before FastAPI does): with an API key set,
every route but `/health` needs `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`
(compared in constant time with
hmac.compare_digest; the key and what clients sent are never logged or echoed); a body
larger than `max_request_bytes` is refused with 413 - at once when Content-Length says so,
else as soon as the bytes read pass the limit. Refusals are OpenAI-style error bodies.
Owns: those two checks. Does not own: request semantics or admission (admission.py).
"""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from fastapi import HTTPException

from justapi.frontend.admission import RejectionCounter
from justapi.frontend.errors import INVALID_REQUEST, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
"""Routes served without the API key (load balancer and orchestrator probes)."""
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class BodyTooLarge(HTTPException):
    """Raised from inside body reading (FastAPI re-raises HTTPExceptions as they are)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return f"the request body is larger than {limit} bytes (the server's max-request-bytes)"


class HttpGuards:
    """ASGI middleware: API key (when set), then the body size limit, then the app."""

    def __init__(self, app: ASGIApp, *, api_key: str = "",
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 rejections: RejectionCounter | None = None) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.app = app
        self._key = api_key.encode()
        self.max_request_bytes = max_request_bytes
        self._rejections = rejections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._key and scope.get("path") not in OPEN_PATHS and not self._authorized(scope):
            self._count("unauthorized")
            await _respond(send, 401, "missing or incorrect API key (send the header "
                           "'Authorization: Bearer KEY')", "invalid_api_key",
                           {"www-authenticate": "Bearer"})
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_request_bytes:
            self._count("too_large")
            await _respond(send, 413, too_large_message(self.max_request_bytes),
                           "request_too_large")
            return
        await self.app(scope, self._limited(receive), send)

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, given = bytes(value).partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(bytes(value).strip(), self._key):
                return True
        return False

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that raises BodyTooLarge once the body read passes the limit (a chunked
        upload, or one that sends more than its Content-Length)."""
        num_read = 0

        async def wrapped() -> Message:
            nonlocal num_read
            message = await receive()
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > self.max_request_bytes:
                    self._count("too_large")
                    raise BodyTooLarge(self.max_request_bytes)
            return message

        return wrapped

    def _count(self, reason: str) -> None:
        if self._rejections is not None:
            self._rejections.count(reason)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses it before us; nothing to check
    return None


async def _respond(send: Send, status: int, message: str, code: str,
                   headers: dict[str, str] | None = None) -> None:
    body = orjson.dumps(error_body(message, INVALID_REQUEST, None, code))
    raw_headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
