"""The client side of an OpenAI-compatible server, on aiohttp: ``pluginfer chat --base-url`` and
``pluginfer bench serve`` (one HTTP stack; aiohttp is already a runtime dependency, the server's)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator

import aiohttp

from pluginfer.cli.chat_loop import TurnEnd

# Errors of a request that did not get through (refused connection, timeout, broken stream).
REQUEST_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class ServerError(RuntimeError):
    """The server refused a request (HTTP status) or reported an error inside the stream."""


def api_root(base_url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` name the same server."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def auth_headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def error_message(body: object) -> str:
    """The ``message`` of an OpenAI error body ``{"error": {"message": ...}}``, else the body itself."""
    if isinstance(body, (str, bytes)):
        try:
            body = json.loads(body)
        except ValueError:
            return (body.decode(errors="replace") if isinstance(body, bytes) else body).strip()[:200]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


async def list_models(session: aiohttp.ClientSession, root: str, api_key: str | None,
                      timeout: float = 30.0) -> list[dict]:
    """The entries of ``GET /v1/models``; [] when the server answers it with an error status other than
    401/403, which are a ValueError saying the key was refused (every request would be)."""
    try:
        async with session.get(f"{root}/v1/models", headers=auth_headers(api_key),
                               timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status in (401, 403):
                sent = "" if api_key else " (none was sent: pass --api-key)"
                raise ValueError(f"the server refused the API key{sent}: {response.status} "
                                 f"{error_message(await response.text())}")
            if response.status != 200:
                return []
            body = await response.json(content_type=None)
    except REQUEST_ERRORS as exc:
        raise ValueError(f"cannot reach {root}: {type(exc).__name__}: {exc}") from None
    data = body.get("data") if isinstance(body, dict) else None
    return [entry for entry in data if isinstance(entry, dict)] if isinstance(data, list) else []


def fetch_models(root: str, api_key: str | None) -> list[dict]:
    """:func:`list_models` from synchronous code."""
    async def fetch() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return await list_models(session, root, api_key)

    return asyncio.run(fetch())


async def sse_data(stream: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The data of each event of a server-sent-event stream: an event ends at a blank line, its ``data:``
    lines joined by newlines; comments and other fields are skipped."""
    data: list[str] = []
    async for raw in stream:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


async def stream_chat(session: aiohttp.ClientSession, root: str, payload: dict, api_key: str | None,
                      read_timeout: float) -> AsyncIterator[str | TurnEnd]:
    """Pieces of the assistant's answer as the server streams them, then its ``TurnEnd`` (the finish_reason),
    if the server sent one (``read_timeout``: the longest wait for the next piece, not for the whole answer)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=read_timeout)
    try:
        async with session.post(f"{root}/v1/chat/completions", json=payload, headers=auth_headers(api_key),
                                timeout=timeout) as response:
            if response.status != 200:
                raise ServerError(f"HTTP {response.status}: {error_message(await response.text())}")
            async for data in sse_data(response.content):
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if not isinstance(event, dict) or "error" in event:
                    raise ServerError(error_message(event))
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece
                    if choice.get("finish_reason"):
                        yield TurnEnd(choice["finish_reason"])
    except REQUEST_ERRORS as exc:
        raise ServerError(f"cannot reach {root}: {type(exc).__name__}: {exc}") from None
