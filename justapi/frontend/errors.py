"""OpenAI-style API errors: the exception the serving code raises and the body it becomes.

Every refusal leaves the server as `{"error": {"message", "type", "param", "code"}}` with a
4xx/5xx status. Owns: that shape and the mapping of validation errors onto it. Does not own:
deciding what is invalid (prompts.py, request_sampling.py, SamplingParams, the tokenizer and
chat template).
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class ApiError(ValueError):
    """A request the server refuses; `status`, `param` and `code` go into the error body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, error_type: str = INVALID_REQUEST,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.error_type = error_type
        self.headers = dict(headers or {})
        """Extra response headers (Retry-After on 429/503)."""

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


ANTHROPIC_TYPES = {SERVER_ERROR: "api_error", UNAVAILABLE: "overloaded_error"}
"""Our error types that Anthropic names otherwise (invalid_request_error, not_found_error are
the same)."""


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    """The error as Anthropic's API writes it (/v1/messages)."""
    kind = "rate_limit_error" if error.status == 429 else \
        ANTHROPIC_TYPES.get(error.error_type, error.error_type)
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def from_validation_errors(errors: Sequence[Any]) -> ApiError:
    """pydantic/FastAPI validation errors -> one ApiError naming the first bad field."""
    if not errors:
        return ApiError("invalid request")
    first = _most_specific(errors)
    kind = str(first.get("type", "")) or None
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(f"request body is not valid JSON: {detail}".rstrip(": "),
                        code="invalid_json")
    location, is_union = _field_path(first.get("loc", ()))
    param = ".".join(location) or None
    if param is None:
        return ApiError(f"request body: {first.get('msg', 'invalid')} (expected a JSON object)",
                        code=kind)
    if kind == "missing":
        return ApiError(f"missing required parameter {param!r}", param=param, code=kind)
    if is_union:  # one error per accepted type: name the value instead of listing them all
        value = first.get("input")
        return ApiError(f"{param}: a value of type {type(value).__name__} ({value!r:.40}) is "
                        f"not accepted here", param=param, code=kind)
    return ApiError(f"{param}: {first.get('msg', 'invalid value')}", param=param, code=kind)


def _field_path(loc: Sequence[Any]) -> tuple[list[str], bool]:
    """('body', 'messages', 0, 'content', 'list[TextPart]', 0, 'type') ->
    (['messages', '0', 'content', '0', 'type'], True): pydantic's union-member tags dropped."""
    path: list[str] = []
    is_union = False
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS
                                      or part[:1].isupper()):
            is_union = True
            continue
        path.append(str(part))
    return path, is_union


def _most_specific(errors: Sequence[Any]) -> Any:
    """A union field fails once per accepted type; when exactly one member got deeper into
    the value than the others (a list of parts with one bad part), its error is the useful one."""
    first = errors[0]
    base, is_union = _field_path(first.get("loc", ()))
    if not is_union:
        return first
    same_field = [e for e in errors if _field_path(e.get("loc", ()))[0][:len(base)] == base]
    depth = {id(e): len(_field_path(e.get("loc", ()))[0]) for e in same_field}
    deepest = max(depth.values())
    candidates = [e for e in same_field if depth[id(e)] == deepest]
    return candidates[0] if len(candidates) == 1 and deepest > len(base) else first


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def sampling_error(exc: ValueError, known_params: Sequence[str]) -> ApiError:
    """A SamplingParams ValueError ('top_p must be in (0, 1], got 2') -> ApiError with param."""
    message = str(exc)
    first_word = message.split(" ", 1)[0]
    return ApiError(message, param=first_word if first_word in known_params else None)


def renamed(error: ApiError, renames: Sequence[tuple[str, str]]) -> ApiError:
    """An error of the internal chat request spoken in a translated API's field names:
    each (regex, replacement) applied to its param and message (e.g. max_completion_tokens ->
    max_output_tokens on /v1/responses)."""
    param, message = error.param, error.message
    for pattern, replacement in renames:
        if param is not None:
            param = re.sub(pattern, replacement, param)
        message = re.sub(pattern, replacement, message)
    return ApiError(message, param=param, status=error.status, code=error.code,
                    error_type=error.error_type, headers=error.headers)


@contextmanager
def renaming(renames: Sequence[tuple[str, str]]) -> Iterator[None]:
    """ApiErrors raised inside come out `renamed` for the translated API."""
    try:
        yield
    except ApiError as exc:
        raise renamed(exc, renames) from None
