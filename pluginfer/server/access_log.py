"""The access log: one INFO line per HTTP request on the ``pluginfer.access`` logger (``server.access_log``),
as vLLM's and llama.cpp's servers write one::

    INFO pluginfer.access: POST /v1/chat/completions 200 chatcmpl-1f0c... prompt_tokens=12 completion_tokens=30 412.5 ms

The handlers' engine requests add their id and token counts through a context variable, so no handler
passes anything along.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from aiohttp import web

logger = logging.getLogger("pluginfer.access")


@dataclass
class _Entry:
    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0


_ENTRY: ContextVar[_Entry | None] = ContextVar("pluginfer_access_entry", default=None)


def count_tokens(request_id: str, prompt_tokens: int, completion_tokens: int) -> None:
    """Add an engine request's tokens to the access line of the HTTP request being handled (if any)."""
    entry = _ENTRY.get()
    if entry is not None:
        entry.request_id = request_id if entry.request_id == "-" else entry.request_id
        entry.prompt_tokens += prompt_tokens
        entry.completion_tokens += completion_tokens


def access_log_middleware() -> Any:
    """The middleware that writes the line; outside the error middleware, so it sees the status sent.
    The logger is set to INFO unless it has a level already: the line shows under the default --log-level."""
    from pluginfer.server.streaming import CLIENT_LEFT  # here: streaming imports this module

    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)

    @web.middleware
    async def log_access(request: web.Request, handler: Any) -> web.StreamResponse:
        entry, started, status = _Entry(), time.perf_counter(), 500
        token = _ENTRY.set(entry)
        try:
            response = await handler(request)
            status = 499 if request.get(CLIENT_LEFT) else response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            status = 499  # the client closed the connection first (nginx's code)
            raise
        finally:
            _ENTRY.reset(token)
            logger.info("%s %s %d %s prompt_tokens=%d completion_tokens=%d %.1f ms", request.method, request.path,
                        status, entry.request_id, entry.prompt_tokens, entry.completion_tokens,
                        (time.perf_counter() - started) * 1000)

    return log_access
