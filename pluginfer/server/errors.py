"""Errors in the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``, with their status.

Handlers raise :class:`APIError`; the middleware turns it, aiohttp's own HTTP errors
(unknown route, oversized body) and anything unexpected (a 500, logged) into that shape, or into the
shape of another API where the route's handler says so (``answers_errors_as``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import ValidationError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}
_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+): ")
Handler = TypeVar("Handler", bound=Callable[..., Any])


class APIError(Exception):
    """A request that fails with ``status``; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_validation_error(error: ValidationError) -> APIError:
    """The first pydantic error, with its location as ``param`` (``messages.0.content``)."""
    problems = error.errors(include_url=False)
    first = problems[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    message = "; ".join(f"{'.'.join(map(str, p['loc'])) or 'body'}: {p['msg'].removeprefix('Value error, ')}"
                        for p in problems[:5])
    return bad_request(message, param)


def from_sampling_error(error: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A SamplingParams ValueError ('SamplingParams.seed: ...') names the request field."""
    message = str(error)
    match = _SAMPLING_FIELD.match(message)
    param = None
    if match:
        param = (renames or {}).get(match.group(1), match.group(1))
        message = f"{param}: {message[match.end():]}"
    return bad_request(message, param)


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> APIError:
    if exc.status == 404:
        return APIError(404, f"not found: {request.method} {request.path}", code="not_found")
    if exc.status == 405:
        return APIError(405, f"method {request.method} not allowed for {request.path}", code="method_not_allowed")
    if exc.status == 413:
        return APIError(413, f"request body too large: {exc.text}", code="request_too_large")
    return APIError(exc.status, exc.text or exc.reason or "HTTP error")


def answers_errors_as(body: Callable[[APIError], dict[str, Any]]) -> Callable[[Handler], Handler]:
    """Mark a route's handler: its errors, the middlewares' included (a missing API key), leave as ``body(error)``."""
    def mark(handler: Handler) -> Handler:
        handler.error_body = body  # type: ignore[attr-defined]
        return handler
    return mark


def _response(request: web.Request, error: APIError) -> web.Response:
    body = getattr(request.match_info.handler, "error_body", None)
    return web.json_response(body(error), status=error.status) if body else error.response()


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves in the OpenAI shape; bad input never becomes a 500."""
    try:
        return await handler(request)
    except APIError as exc:
        return _response(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _response(request, _from_http_exception(exc, request))
    except ValidationError as exc:
        return _response(request, from_validation_error(exc))
    except ConnectionError:  # the client went away mid-response: nobody to answer
        raise
    except Exception as exc:
        logger.exception("unexpected error serving %s %s", request.method, request.path)
        return _response(request, APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))


def sse_error(error: APIError) -> bytes:
    """An error after a stream started: one ``data:`` event with the error body (then [DONE])."""
    return f"data: {json.dumps(error.body())}\n\n".encode()
